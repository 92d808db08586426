"""bench/pd.py's codec part on the tiny model (no Ray: the in-process and the emulated link): every
policy ships what it says, auto tries every codec during warm-up where that is worth it, and the
table renders."""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.tiny_model import write_tiny_model
from actors.worker_config import WorkerConfig
from bench.pd_codecs import AUTOS, POLICIES, links, render_codecs, run_link, summarize
from tests.actors.workers.harness import random_tokens
from transfer.config import TransferConfig


def test_codec_bench_on_the_tiny_model(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny", seed=0)
    cfg = WorkerConfig(model=str(model), engine=EngineConfig(num_blocks=64), transfer=TransferConfig(kind="local"))
    prompts = [random_tokens(n, seed=n) for n in (40, 90)]
    figures = {"prompt_tokens": [40, 90], "rounds": 2, "links": {}}
    for link in links(0.001, ["local", "emulated"]):  # 1 MB/s: the emulated link is slow
        warm, samples = asyncio.run(run_link(link, cfg, prompts, 2, lambda: Engine.from_pretrained(model, cfg.engine)))
        assert len(samples) == 2 * 2 * len(POLICIES)
        for s in samples + warm:
            assert s.policy in AUTOS or s.result.kv_codec == s.policy
            if s.policy == "auto":  # exact, the default: lossless codecs only
                assert s.result.kv_codec in ("none", "zstd") and s.result.kv_fidelity == "exact"
            assert s.decode_s > 0 and s.total_s > s.result.kv_encode_s
        reasons = {s.result.kv_codec_reason for s in warm + samples if s.policy in AUTOS}
        if link.key == "emulated":  # 1 MB/s: KB-sized differences take ms, worth exploring
            tried = {s.result.kv_codec for s in warm if s.policy == "auto-lossy"}
            assert tried == {"none", "zstd", "int8", "fp8"}  # warm-up lasts until auto has sent with each
            assert {s.result.kv_codec for s in warm if s.policy == "auto"} == {"none", "zstd"}
        else:  # in-process, a few KB: nothing worth exploring (explore_min_s)
            assert reasons == {"predicted"}
        figures["links"][link.name] = {**summarize(samples), "warmup": summarize(warm)}
    emulated = figures["links"]["EMULATED 0.001 GB/s (throttled local)"]["policies"]
    assert emulated["none"]["send_ms_mean"] > 2 * emulated["int8"]["send_ms_mean"]  # 4x the bytes at 1 MB/s
    table = render_codecs(figures)
    assert "EMULATED 0.001 GB/s" in table and "auto <= best exact" in table
