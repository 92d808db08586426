"""The prefix-cache pool's tiers on SmolLM2-135M block sizes: disk vs DRAM, prefetch, tenants.

Real store and pool objects in this process (one store, `LocalStoreHandle`, as the embedded default
runs one), real KV block layout (SmolLM2-135M: 30 layers, 3 KV heads x 64, 16-token blocks, fp32:
0.70 MiB a block), prompts are windows of this repository's docs, tokenized.
- (a) tiers: `--repeats` requests per case, each a new `--prompt-tokens` prefix computed once by
  the real engine and offered to the pool, then looked up by a request of the same prefix plus 32
  new tokens: lookup (pool fetch, decode, import) and prefill of the rest, the prefill side of TTFT.
  Cases: prefix in DRAM; on disk in the page cache; on disk cold (its files dropped from the page
  cache, `posix_fadvise DONTNEED`); cold disk after a prefetch (the request waited for a decode row
  at least as long as the prefetch took, which is reported).
- (b) tenants: tenant "b" reads its `--working-set` prefixes round after round (a miss offers the
  chain again, as a prefill would); tenant "flood" offers `--flood` unique `--flood-tokens` prompts
  per round. b's prefix hit rate (leading blocks found / blocks asked, after a warm-up round), solo
  and flooded, for plain LRU, value order, and value order with b guaranteed half of each tier.
  Payloads are real-sized (random bytes: what is measured does not depend on their content).
- (c) per tier: hit rates, bytes moved and prefetch accuracy of the stores behind (a) and (b).

    .venv/bin/python bench/pool.py [--parts tiers,tenants] [--prompt-tokens 1024] [--repeats 3] [--working-set 2] [--flood 1]
        [--flood-tokens 2048] [--rounds 4] [--dram-mib 64] [--disk-mib 128] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    _here = Path(__file__).resolve().parent  # import from the repository root, not bench/
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import torch

from actors.engine.async_engine import AsyncEngine
from actors.engine.block_hash import BlockHash, hash_block_chain
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.fetch import resolve_model
from actors.engine.sampling import SamplingParams
from actors.engine.shares import TenantShare, TenantShares
from actors.engine.tokenizer import Tokenizer
from actors.engine.weights import read_config
from actors.handoff import kv_layout, num_reusable_blocks, prompt_block_hashes
from actors.messages import GenerationRequest
from actors.pool_link import PoolLink, import_prefix
from actors.prefix_cache.handles import LocalStoreHandle
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.stats import PrefixCacheStats
from actors.prefix_cache.config import PrefixCacheConfig
from actors.prefix_cache.store import PrefixCacheStore
from bench.common import bench_parser, format_table, progress, run
from bench.shadow import doc_tokens, windows
from transfer.codec import KVLayout, encode
from transfer.units import MIB

BLOCK = 16
SUFFIX = 32  # new tokens after the cached prefix
CASES = ("dram", "disk_page_cache", "disk_cold", "disk_cold_prefetched")
PARAMS = SamplingParams(max_tokens=1, temperature=0)


def one_store_pool(cfg: PrefixCacheConfig, name: str) -> tuple[PrefixCachePool, PrefixCacheStore]:
    store = PrefixCacheStore(cfg, name)
    return PrefixCachePool({StoreId(name): LocalStoreHandle(store)}, timeout_s=60.0), store


def drop_page_cache(store: PrefixCacheStore, hashes: list[BlockHash]) -> None:
    """Evicts these blocks' files from the page cache (only ours: no system-wide drop)."""
    for h in hashes:
        path = store.disk_path(h)
        if path is not None and path.exists():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Prefiller:
    """The prefill worker's lookup and compute steps (`PrefillWorker.prefill` without the ship)."""

    def __init__(self, model: str, num_blocks: int, pool: PrefixCachePool) -> None:
        engine = Engine.from_pretrained(model, EngineConfig(num_blocks=num_blocks, block_size=BLOCK))
        self.engine = AsyncEngine(engine)
        self.link = PoolLink(pool, kv_layout(engine))

    async def compute(self, req: GenerationRequest) -> tuple[int, int]:
        """(leading blocks reused from this engine, from the pool) of `req`, prefilled; KV released."""
        reusable = self.reusable(req)
        num_local, num_pool = await asyncio.to_thread(import_prefix, self.engine, self.link, reusable)
        async for _ in self.engine.generate(req.request_id, list(req.prompt_token_ids), req.params,
                                            req.engine_options(prefill_only=True)):
            pass
        return num_local, num_pool

    def offer(self, req: GenerationRequest) -> None:
        """Offers the computed prompt's full blocks, as the prefill worker does after its ship."""
        e = self.engine.engine
        hashes = prompt_block_hashes(req, BLOCK)
        block_ids, _ = e.held_kv(req.request_id)
        self.link.offer(hashes, e.runner.read_blocks(block_ids[: len(hashes)]), req.tenant)
        assert self.link.flush(120.0)

    def release(self, req: GenerationRequest) -> None:
        self.engine.locked(self.engine.engine.release_kv, req.request_id)

    def reusable(self, req: GenerationRequest) -> list[BlockHash]:
        return prompt_block_hashes(req, BLOCK)[: num_reusable_blocks(req.num_prompt_tokens, BLOCK)]

    def prefetch(self, req: GenerationRequest) -> None:
        """`PrefillWorker.prefetch`: the pool part of the chain this engine lacks."""
        reusable = self.reusable(req)
        self.link.prefetch(reusable[self.engine.locked(self.engine.engine.cached_prefix_len, reusable):])

    def close(self) -> None:
        self.link.close()
        self.engine.shutdown()


def block_payload_bytes(model: str) -> int:
    """Bytes of one pool block of `model` (one 16-token block, all layers, fp32 KV, codec header)."""
    m = read_config(model)
    layout = KVLayout(m.name, m.num_layers, m.num_kv_heads, m.head_dim, BLOCK)
    kv = torch.zeros(m.num_layers, 2, 1, BLOCK, m.num_kv_heads, m.head_dim)
    (payload,) = encode(kv, layout, compression="none", num_shards=1, block_hashes=[1])
    return len(payload)


async def tiers(args: argparse.Namespace, model: str, tokens: list[int], tmp: str, block_bytes: int) -> dict[str, Any]:
    """(a): the prefill side of TTFT with the prefix in each tier."""
    prompt_blocks = args.prompt_tokens // BLOCK
    # DRAM holds about two prompts, so every new prefix pushes older ones down to disk.
    cfg = PrefixCacheConfig(dram_bytes=2 * prompt_blocks * block_bytes, disk_bytes=1 << 40, disk_dir=tmp)
    pool, store = one_store_pool(cfg, "tiers")
    # The engine holds a bit more than one prompt: each prefix computed evicts the one before it,
    # so every lookup measured below comes from the pool, not from the engine's own cache.
    p = Prefiller(model, prompt_blocks + SUFFIX // BLOCK + 8, pool)
    n = len(CASES) * args.repeats
    prefixes = windows(tokens, args.prompt_tokens, n + 2, start=4099)
    try:
        progress(f"(a) computing {n + 2} prefixes of {args.prompt_tokens} tokens and offering them")
        for i, prefix in enumerate(prefixes):
            req = GenerationRequest(f"setup-{i}", prefix + tokens[:SUFFIX], PARAMS)
            await p.compute(req)
            p.offer(req)
            p.release(req)
        rows: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
        for i in range(n):
            case = CASES[i % len(CASES)]
            req = GenerationRequest(f"a-{i}", prefixes[i] + tokens[SUFFIX * (i + 2): SUFFIX * (i + 3)], PARAMS)
            chain = p.reusable(req)
            if case == "dram":
                pool.get_prefix(chain)  # read once: brought up to DRAM
            elif case != "disk_page_cache":
                drop_page_cache(store, chain)
            disk = set(store.disk_eviction_order())
            on_disk = sum(h in disk for h in chain)
            prefetch_s = 0.0
            if case == "disk_cold_prefetched":
                t0 = time.perf_counter()
                p.prefetch(req)  # local stores run it inside the call: this is its whole time
                prefetch_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            num_local, num_pool = await p.compute(req)
            ttft_s = time.perf_counter() - t0
            p.release(req)
            assert num_local == 0, f"{req.request_id}: the engine still had {num_local} blocks"
            rows[case].append({"ttft_s": ttft_s, "pool_blocks": num_pool, "blocks_on_disk": on_disk,
                               "prefetch_s": prefetch_s})
            progress(f"  {case}: {num_pool}/{len(chain)} blocks from the pool ({on_disk} on disk), "
                     f"prefill side of TTFT {ttft_s * 1e3:.0f} ms" + (f", prefetch {prefetch_s * 1e3:.0f} ms"
                                                                      if prefetch_s else ""))
    finally:
        p.close()
    out: dict[str, Any] = {}
    for case, rs in rows.items():
        out[case] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    base = out["dram"]["ttft_s"]
    for case in CASES:
        out[case]["vs_dram"] = out[case]["ttft_s"] / base
    out["stats"] = store.stats().to_dict()
    store.close()
    return out


def chain_of(tag: str, n_blocks: int) -> list[BlockHash]:
    return hash_block_chain(list(range(n_blocks * BLOCK)), BLOCK, (tag,))  # a salt of its own: a chain of its own


def tenants_run(cfg: PrefixCacheConfig, args: argparse.Namespace, payload: bytes, flood: bool,
                name: str) -> tuple[float, PrefixCacheStats]:
    """(b) one run: b's prefix hit rate after the warm-up round, and the store's stats."""
    pool, store = one_store_pool(cfg, name)
    working = [chain_of(f"b{i}", args.prompt_tokens // BLOCK) for i in range(args.working_set)]
    hits = asked = 0
    try:
        for r in range(args.rounds):
            for i, chain in enumerate(working):
                got = len(pool.get_prefix(chain))
                if r > 0:
                    hits, asked = hits + got, asked + len(chain)
                if got < len(chain):  # recomputed, then offered: the part the pool lacks
                    pool.put([(h, payload) for h in chain[got:]], tenant="b", first_depth=got).wait()
                for j in range(args.flood if flood else 0):  # interleaved with b's requests
                    one_off = chain_of(f"flood-{name}-{r}-{i}-{j}", args.flood_tokens // BLOCK)
                    pool.put([(h, payload) for h in one_off], tenant="flood").wait()
        store.check_integrity()
        return hits / asked, store.stats()
    finally:
        store.close()


def tenants(args: argparse.Namespace, tmp: str, block_bytes: int) -> dict[str, Any]:
    payload = os.urandom(block_bytes)
    policies = {
        "lru": {"eviction": "lru"},
        "value": {"eviction": "value"},
        "value+shares": {"eviction": "value",
                         "tenant_shares": TenantShares.of_mapping({"b": TenantShare(guaranteed=0.5)})},
    }
    out: dict[str, Any] = {}
    for policy, kw in policies.items():
        cfg = PrefixCacheConfig(dram_bytes=args.dram_mib * MIB, disk_bytes=args.disk_mib * MIB, disk_dir=tmp,
                                **kw)  # type: ignore[arg-type]
        solo, _ = tenants_run(cfg, args, payload, False, f"{policy.replace('+', '-')}-solo")
        flooded, stats = tenants_run(cfg, args, payload, True, f"{policy.replace('+', '-')}-flood")
        out[policy] = {"b_hit_rate_solo": solo, "b_hit_rate_flooded": flooded,
                       "flooded_vs_solo": flooded / solo if solo else 0.0, "stats": stats.to_dict()}
        progress(f"(b) {policy}: b's hit rate solo {solo:.3f}, flooded {flooded:.3f}")
    return out


def tier_figures(s: dict[str, int]) -> dict[str, float]:
    st = PrefixCacheStats.from_dict(s)
    return {"dram_hit_rate": st.dram_hit_rate, "disk_hit_rate": st.disk_hit_rate,
            "mib_put_dram": st.bytes_put_dram / MIB, "mib_put_disk": st.bytes_put_disk / MIB,
            "mib_spilled": st.bytes_spilled / MIB, "mib_promoted": st.bytes_promoted / MIB,
            "mib_served_dram": st.bytes_served_dram / MIB, "mib_served_disk": st.bytes_served_disk / MIB,
            "dram_refused": st.num_dram_refused, "disk_refused": st.num_disk_refused,
            "refused_at_max": st.num_dram_refused_at_max + st.num_disk_refused_at_max,
            "prefetched": st.num_prefetched, "prefetch_accuracy": st.prefetch_accuracy}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = str(resolve_model(args.model))
    block_bytes = block_payload_bytes(model)
    out: dict[str, Any] = {"model": args.model, "block_bytes": block_bytes, "per_tier": {},
                           "config": {k: v for k, v in vars(args).items() if k not in ("json", "tmp")}}
    with tempfile.TemporaryDirectory(prefix="ferry-pool-", dir=args.tmp) as tmp:
        if "tiers" in args.parts:
            out["tiers"] = await tiers(args, model, doc_tokens(Tokenizer.load(model)), tmp, block_bytes)
            out["per_tier"]["tiers"] = tier_figures(out["tiers"].pop("stats"))
        if "tenants" in args.parts:
            out["tenants"] = tenants(args, tmp, block_bytes)
            out["per_tier"].update({f"tenants {p}": tier_figures(r.pop("stats")) for p, r in out["tenants"].items()})
    return out


def render(f: dict[str, Any]) -> str:
    c = f["config"]
    parts = []
    if "tiers" in f:
        a = [[case, r["ttft_s"] * 1e3, r["vs_dram"], r["pool_blocks"], r["blocks_on_disk"], r["prefetch_s"] * 1e3]
             for case, r in f["tiers"].items()]
        parts.append(format_table(
            ["prefix", "prefill TTFT ms", "x DRAM", "pool blocks", "on disk", "prefetch ms"], a,
            f"(a) {c['prompt_tokens']}-token prefix + {SUFFIX} new tokens, {f['block_bytes']:,}-byte blocks, "
            f"median of {c['repeats']}"))
    if "tenants" in f:
        b = [[p, r["b_hit_rate_solo"], r["b_hit_rate_flooded"], r["flooded_vs_solo"]] for p, r in f["tenants"].items()]
        parts.append(format_table(
            ["policy", "b hit rate solo", "flooded", "flooded/solo"], b,
            f"(b) b: {c['working_set']} x {c['prompt_tokens']}-token prefixes; flood: {c['flood']} unique "
            f"{c['flood_tokens']}-token prompts per b request; DRAM {c['dram_mib']} MiB, disk {c['disk_mib']} MiB; "
            f"{c['rounds']} rounds"))
    keys = list(next(iter(f["per_tier"].values())))
    t = [[name, *(r[k] for k in keys)] for name, r in f["per_tier"].items()]
    parts.append(format_table(["store", *keys], t, "(c) per tier (flooded runs for b)"))
    return "\n\n".join(parts)


def main() -> None:
    ap = bench_parser(__doc__, model="smollm2", threads=2)
    ap.add_argument("--parts", default="tiers,tenants", help="comma-separated: tiers (a), tenants (b)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--working-set", type=int, default=2)
    ap.add_argument("--flood", type=int, default=1)
    ap.add_argument("--flood-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dram-mib", type=int, default=64)
    ap.add_argument("--disk-mib", type=int, default=128)
    ap.add_argument("--tmp", default=None, help="folder for the disk tiers (default: the system's temp folder)")
    run(bench, ap.parse_args(), render)


if __name__ == "__main__":
    main()
