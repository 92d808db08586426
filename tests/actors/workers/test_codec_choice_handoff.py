"""Prefill -> decode handoffs with `compression: auto`: each transfer ships the codec the chooser
picked (none over a fast link; over a slow one zstd, lossless, for a tenant with exact KV, the
default, and a lossy codec for a tenant that opted into lossy KV), the decode worker's tokens are
those of that codec's KV (the engine's own for exact tenants), and the prefill report carries the
choice with its predicted and actual seconds and the tenant's fidelity."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.messages import GenerationRequest
from transfer.codec import Compression
from transfer.codec_choice import ALL_CODECS, ChooserConfig, CodecChooser
from transfer.codec_cost import CodecCost

from .harness import GREEDY, LOSSY, LocalCluster, Run, random_tokens, reference, worker_config

MB = 1_000_000


class SteeredChooser(CodecChooser):
    """A chooser the test alone feeds: the real transfers' measurements (`record`) are left out, so
    what it predicts is what the test set (tests/transfer/test_codec_choice.py covers updates)."""

    def record(self, *args: object, **kw: object) -> None:
        pass

    def steer(self, peer: str, codec: Compression, raw: int, wire: int, encode_s: float, wire_s: float) -> None:
        super().record(peer, codec, raw, wire, encode_s, wire_s)


# Steered codec lines, seconds per MB each way, and wire ratios: none is the cheapest codec, int8
# and fp8 alike shrink the bytes most, zstd (lossless) less and slower.
PER_MB = {Compression.NONE: 1e-4, Compression.INT8: 3e-4, Compression.FP8: 3e-4, Compression.ZSTD: 2e-3}
RATIO = {Compression.NONE: 1.0, Compression.INT8: 0.3, Compression.FP8: 0.3, Compression.ZSTD: 0.7}


def steered_chooser() -> SteeredChooser:
    """Codec lines as PER_MB and RATIO say, and no exploration: the link alone decides."""
    costs = {}
    for c in ALL_CODECS:
        cost = costs[c] = CodecCost(c)
        for raw in (MB, 4 * MB):
            cost.encode.add(raw, PER_MB[c] * raw / MB)
            cost.decode.add(raw, PER_MB[c] * raw / MB)
        cost.wire_ratio = RATIO[c]
    return SteeredChooser(costs, ChooserConfig(explore_every=10_000))


def set_wire(chooser: SteeredChooser, peer: str, bytes_per_s: float) -> None:
    """Sends of every codec (none is left to explore), encoded at the steered lines' cost."""
    for _ in range(30):  # enough decayed samples that earlier ones no longer count
        for size in (10_000, 40_000):
            for c in ALL_CODECS:
                wire = int(RATIO[c] * size)
                chooser.steer(peer, c, size, wire, PER_MB[c] * size / MB, wire / bytes_per_s)


def test_auto_ships_the_chosen_codec_and_decodes_its_tokens(tiny_model_dir: Path) -> None:
    prompts = [random_tokens(n, seed=100 + n) for n in (20, 37, 50)]
    exact = reference(tiny_model_dir, prompts, GREEDY)

    async def main() -> dict[str, list[Run]]:
        cfg = worker_config(tiny_model_dir, compression="auto", tenant_kv=(("lab", LOSSY),))
        cluster = await LocalCluster.start(cfg)
        chooser = cluster.prefills[0].codecs = steered_chooser()
        runs: dict[str, list[Run]] = {}
        try:
            async def batch(tag: str, tenant: str = "default") -> list[Run]:
                reqs = [GenerationRequest(f"{tag}{i}", p, GREEDY, tenant=tenant) for i, p in enumerate(prompts)]
                return list(await asyncio.gather(*(cluster.run(r) for r in reqs)))

            set_wire(chooser, cluster.peer, 1e6)  # 1 MB/s: bytes are dear
            runs["slow"] = await batch("slow-", tenant="lab")
            runs["slow, exact tenant"] = await batch("bank-")
            set_wire(chooser, cluster.peer, 1e12)
            runs["fast"] = await batch("fast-", tenant="lab")
            assert cluster.decode is not None and cluster.decode.receiver_stats().num_committed == 9
            decoded = cluster.decode.receiver_stats().decoded_raw_bytes
            assert set(decoded) == {"none", "zstd"} | {r.result.kv_codec for r in runs["slow"]}  # type: ignore[union-attr]
        finally:
            cluster.close()
        return runs

    runs = asyncio.run(main())
    lossy = [r.result.kv_codec for r in runs["slow"]]  # type: ignore[union-attr]
    assert set(lossy) == {"int8"}  # int8 and fp8 are steered alike: a tie goes to the first codec
    assert [r.result.kv_codec for r in runs["slow, exact tenant"]] == ["zstd"] * 3  # type: ignore[union-attr]
    assert [r.result.kv_codec for r in runs["fast"]] == ["none"] * 3  # type: ignore[union-attr]
    for name in ("slow, exact tenant", "fast"):
        assert [r.token_ids for r in runs[name]] == exact  # lossless: the engine's own tokens
    reasons = {name: {r.result.kv_codec_reason for r in rs} for name, rs in runs.items()}  # type: ignore[union-attr]
    assert reasons == {"slow": {"predicted"}, "slow, exact tenant": {"predicted"}, "fast": {"predicted"}}
    fidelity = {name: {r.result.kv_fidelity for r in rs} for name, rs in runs.items()}  # type: ignore[union-attr]
    assert fidelity == {"slow": {"lossy"}, "slow, exact tenant": {"exact"}, "fast": {"lossy"}}
    for run in runs["slow, exact tenant"]:
        assert run.result is not None and set(dict(run.result.kv_codec_predictions)) == {"none", "zstd"}
    for run in runs["slow"]:
        r = run.result
        assert r is not None and set(dict(r.kv_codec_predictions)) == {"none", "int8", "fp8", "zstd"}
        assert r.kv_codec_predicted_s == min(dict(r.kv_codec_predictions).values())
        assert r.kv_codec_actual_s >= r.kv_encode_s + r.kv_send_s > 0
        assert r.kv_wire_bytes < r.kv_raw_bytes / 2

    # Each slow run's tokens are exactly those of a worker forced to its codec: auto shipped it.
    async def forced(codec: str) -> list[list[int]]:
        cluster = await LocalCluster.start(worker_config(tiny_model_dir, compression=codec, default_tenant_kv=LOSSY))
        try:
            reqs = [GenerationRequest(f"forced-{i}", p, GREEDY) for i, p in enumerate(prompts)]
            done = [await cluster.run(r) for r in reqs]
            assert {d.result.kv_codec_reason for d in done} == {"forced"}  # type: ignore[union-attr]
            return [d.token_ids for d in done]
        finally:
            cluster.close()

    want = {codec: asyncio.run(forced(codec)) for codec in set(lossy)}
    assert [r.token_ids for r in runs["slow"]] == [want[c][i] for i, c in enumerate(lossy)]


def test_a_prefill_worker_calibrates_its_chooser_for_its_own_kv(tiny_model_dir: Path) -> None:
    async def main() -> None:
        cluster = await LocalCluster.start(worker_config(tiny_model_dir, compression="auto"))
        try:
            chooser = cluster.prefills[0].codecs
            assert chooser.estimate(cluster.peer).link == "process"  # the in-process transport
            before = chooser.estimate(cluster.peer).num_sends
            run = await cluster.run(GenerationRequest("c", random_tokens(40, seed=5), GREEDY))
            assert run.result is not None and run.result.kv_codec in {"none", "zstd"}  # exact: the default
            assert chooser.estimate(cluster.peer).num_sends == before + 1
            assert run.result.kv_codec_predicted_s == pytest.approx(
                dict(run.result.kv_codec_predictions)[run.result.kv_codec])
        finally:
            cluster.close()

    asyncio.run(main())
