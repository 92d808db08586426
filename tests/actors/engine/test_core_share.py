"""Core sharing between the CPU engines of one node: the claim file, the decode side's banked
slack, and both sides installed on real tiny engines."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from actors.core_share import CoreShare, DecodeYield, PrefillClaim, Row, engine_rows, lend_cores
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_claim_is_seen_by_another_process_and_only_extends(tmp_path: Path) -> None:
    path = tmp_path / "cores"
    share = CoreShare(path)
    assert share.claimed_for() == 0.0
    code = "import sys; from actors.core_share import CoreShare; CoreShare(sys.argv[1]).claim(30.0)"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, cwd=Path(__file__).parents[3])
    assert 25.0 < share.claimed_for() <= 30.0  # one clock for every process of the machine
    share.claim(1.0)  # a shorter claim does not cut a longer one
    assert share.claimed_for() > 25.0
    share.release()
    assert share.claimed_for() == 0.0 and CoreShare(path).claimed_for() == 0.0
    share.close()


def test_decode_yields_only_time_every_row_has_banked(tmp_path: Path) -> None:
    clock = Clock()
    share = CoreShare(tmp_path / "cores", clock)
    lender = DecodeYield(share, tpot_share=0.8, clock=clock, slice_s=0.02)
    rows = [Row("a", 1, 0.2, False), Row("b", 5, 0.1, False)]
    assert lender.pause_s(rows) == 0.0  # no claim
    share.claim(1.0)
    assert lender.pause_s(rows) == 0.0  # claimed, but the rows have banked nothing yet
    clock.t += 0.05  # a step: each made one token in 50 ms
    rows = [Row("a", 2, 0.2, False), Row("b", 6, 0.1, False)]  # banks 0.16-0.05 and 0.08-0.05
    assert lender.pause_s(rows) == pytest.approx(0.02)
    assert lender.bank_s(rows[1], clock.t) == pytest.approx(0.03)
    clock.t += 0.021  # paid: b's bank is now 0.009, under half a slice
    assert lender.pause_s(rows) == 0.0
    # A row without a target, or one still prefilling, never pays for a pause.
    assert lender.pause_s([Row("a", 9, 0.2, False), Row("c", 1, None, False)]) == 0.0
    assert lender.pause_s([Row("a", 9, 0.2, False), Row("d", 1, 0.2, True)]) == 0.0
    assert set(lender._seen) == {"a"}  # c left (forgotten); d, still prefilling, starts banking once it decodes
    clock.t += 2.0  # the claim lapsed
    assert lender.pause_s([Row("a", 60, 0.2, False)]) == 0.0
    share.close()


@pytest.fixture()
def share(tmp_path: Path) -> CoreShare:
    s = CoreShare(tmp_path / "cores")
    yield s
    s.close()


def test_a_decode_engine_pauses_while_claimed_and_emits_the_same_tokens(tiny_llama_dir: Path, share: CoreShare) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 17, 29, 31 + i, 40] for i in range(3)]
    want = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64)).generate(prompts, params)
    ae = AsyncEngine(Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64)))
    lender = lend_cores(ae, "decode", share)
    assert isinstance(lender, DecodeYield) and ae.pause_before_step is not None

    claimed: list[int] = []

    async def one(i: int) -> list[int]:
        ids: list[int] = []
        # a generous target: the tiny model's steps bank most of it
        async for out in ae.generate(f"r{i}", prompts[i], params, RequestOptions(tpot_target_s=1.0)):
            ids += out.new_token_ids
            if len(ids) >= 5 and not claimed:
                claimed.append(i)
                share.claim(0.5)  # a prefill on the node wants the cores, once
        return ids

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in range(3)))

    try:
        got = asyncio.run(main())
    finally:
        ae.shutdown()
    assert got == [list(w.token_ids) for w in want]
    assert lender.num_pauses > 0 and 0 < lender.paused_s <= 0.5 + 0.05


def test_a_prefill_engine_claims_while_it_computes_and_releases_when_idle(tiny_llama_dir: Path, share: CoreShare) -> None:
    ae = AsyncEngine(Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64)))
    claim = lend_cores(ae, "prefill", share)
    assert isinstance(claim, PrefillClaim)
    seen: list[float] = []
    ae.engine.step_hooks.append(lambda prepared: seen.append(share.claimed_for()))

    async def main() -> None:
        async for _ in ae.generate("p", list(range(3, 60)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)):
            pass

    try:
        asyncio.run(main())
        rows = ae.locked(engine_rows, ae.engine)
    finally:
        ae.shutdown()
    assert seen and all(s > 0 for s in seen)  # every step ran under a claim
    assert share.claimed_for() == 0.0 and rows == []  # released once the engine had nothing left
    assert claim.step_s < 1.0  # the tiny model's steps, smoothed from the 1 s first guess
