"""Speculative decoding through the P/D path: a request's opt-out and TPOT target reach the decode
engine (`GenerationRequest.engine_options`), its drafts do not change a greedy stream, every output
carries the running totals, and the decode worker's load reports the engine's counters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.engine.config import EngineConfig
from actors.engine.sampling import SamplingParams
from actors.engine.spec import SpecConfig
from actors.messages import GenerationRequest
from cluster.router.adapters import worker_load
from tests.actors.workers.harness import NUM_BLOCKS, LocalCluster, random_tokens, reference, worker_config

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# early_exit on the 2-layer tiny model drafts with its first layer; "always": every decode step
# verifies max_draft_tokens, so the test does not depend on the engine's pricing.
SPEC = SpecConfig(method="early_exit", max_draft_tokens=3, policy="always")


def test_request_options_carry_the_opt_out_and_the_tpot_target() -> None:
    req = GenerationRequest("r", (1, 2, 3), PARAMS, speculation=False, tpot_target_s=0.05)
    opts = req.engine_options()
    assert (opts.speculation, opts.tpot_target_s) == (False, 0.05)
    assert req.engine_options(prefill_only=True).speculation is False
    default = GenerationRequest("d", (1, 2, 3), PARAMS).engine_options()
    assert (default.speculation, default.tpot_target_s) == (True, None)
    with pytest.raises(ValueError, match="tpot_target_s"):
        GenerationRequest("bad", (1, 2), PARAMS, tpot_target_s=0.0)


def test_a_disaggregated_stream_speculates_unless_opted_out(tiny_model_dir: Path) -> None:
    prompts = [random_tokens(n, seed=70 + n) for n in (9, 20, 33)]
    want = reference(tiny_model_dir, prompts, PARAMS)

    async def main() -> None:
        cfg = worker_config(tiny_model_dir, engine=EngineConfig(num_blocks=NUM_BLOCKS, speculation=SPEC))
        cluster = await LocalCluster.start(cfg)
        try:
            reqs = [GenerationRequest("spec", tuple(prompts[0]), PARAMS, tpot_target_s=0.05),
                    GenerationRequest("off", tuple(prompts[1]), PARAMS, speculation=False),
                    GenerationRequest("plain", tuple(prompts[2]), PARAMS)]
            runs = [await cluster.run(r) for r in reqs]
            assert [run.token_ids for run in runs] == want  # drafts never change a greedy stream
            finals = [run.events[-1].output for run in runs]
            assert all(run.events[-1].output.finished for run in runs)
            # The totals only grow along a stream; every output carries them.
            for run in runs:
                totals = [(e.output.num_draft_tokens, e.output.num_accepted_tokens) for e in run.events]
                assert totals == sorted(totals) and all(a <= d for d, a in totals)
            assert finals[1].num_draft_tokens == 0 and finals[1].num_accepted_tokens == 0
            assert finals[0].num_draft_tokens > 0 and finals[2].num_draft_tokens > 0
            assert cluster.decode is not None
            load = await cluster.decode.load()
            assert load.spec_method == "early_exit" and load.num_spec_rounds > 0
            assert load.num_draft_tokens == sum(f.num_draft_tokens for f in finals)
            assert load.num_accepted_tokens == sum(f.num_accepted_tokens for f in finals)
            assert load.spec_acceptance == pytest.approx(load.num_accepted_tokens / load.num_draft_tokens)
            assert load.spec_report()["method"] == "early_exit"
            # The scheduler's report of the worker carries the counters its cost model prices with.
            report = worker_load(load, 0.0, 16)
            assert (report.num_spec_rounds, report.num_accepted_tokens) == (load.num_spec_rounds,
                                                                           load.num_accepted_tokens)
            prefill = await cluster.prefills[0].load()
            assert prefill.spec_method == "early_exit" and prefill.num_draft_tokens == 0  # prefill-only: no drafts
            for engine in cluster.engines():
                engine.check_integrity()  # rejected drafts' slots all freed
        finally:
            cluster.close()

    asyncio.run(main())
