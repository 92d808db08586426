"""`Engine.resume_from_kv`: requests cut off mid-stream resume on a fresh engine from the KV of
their full blocks, and continue with exactly the tokens of an uninterrupted run, in bfloat16 too;
the tail (at most one block) is replayed one token a step, as the interrupted decode steps ran.
Also on CUDA (`gpu`: the bench/gpu_check.sh run), with CUDA graphs on for the decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams
from actors.engine.tiny_model import write_tiny_model

PARAMS = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=48, temperature=1.0, top_k=50, seed=3, ignore_eos=True)
LENGTHS = (37, 70, 53, 100, 21, 64)


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # wider than the default tiny model, so bf16 rounding has room to change a greedy path
    return write_tiny_model(tmp_path_factory.mktemp("resume-kv"), seed=3, hidden_size=128, num_layers=4,
                            num_heads=4, num_kv_heads=2, intermediate_size=256)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in LENGTHS]


def _run(path: Path, cfg: EngineConfig, params: SamplingParams, cut: int | None) -> dict[str, list[int]]:
    """Every prompt at once; with `cut`, stopped after that many steps and resumed on a second
    engine from the KV of each request's full computed blocks."""
    engine = Engine.from_pretrained(path, cfg)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(LENGTHS))}
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, params, RequestOptions(seed=100 + i))
    steps = 0
    while engine.has_unfinished_requests() and (cut is None or steps < cut):
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
        steps += 1
    if cut is None:
        return outs
    saved = {rid: (req.prompt_token_ids, list(req.output_token_ids),
                   engine.runner.read_blocks(engine.kv.block_ids(rid)[: req.num_computed_tokens // cfg.block_size]))
             for rid, req in engine.requests.items()}
    resumed = Engine.from_pretrained(path, cfg)
    for rid, (prompt, done, kv) in saved.items():
        opts = RequestOptions(output_token_ids=tuple(done), seed=100 + int(rid[1:]))
        assert kv.shape[2] >= 1 and resumed.resume_from_kv(rid, prompt, params, kv, opts)
        assert resumed.requests[rid].num_computed_tokens == kv.shape[2] * cfg.block_size
    forwarded = resumed.stats().num_forwarded_tokens
    while resumed.has_unfinished_requests():
        for o in resumed.step():
            outs[o.request_id] += o.new_token_ids
    resumed.check_integrity()
    # only the tails and the new tokens went through the model, never a whole prefix again
    bs = cfg.block_size
    assert resumed.stats().num_forwarded_tokens - forwarded == sum(
        len(p) + len(d) - (len(p) + len(d) - 1) // bs * bs - 1 + params.max_tokens - len(d)
        for p, d, _ in saved.values())
    return outs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("params", [PARAMS, SEEDED], ids=["greedy", "seeded"])
def test_resumed_from_kv_equals_uninterrupted_in_bfloat16(wider_model: Path, device: str,
                                                         params: SamplingParams) -> None:
    cfg = EngineConfig(device=device, dtype="bfloat16", num_blocks=256)
    want = _run(wider_model, cfg, params, None)
    for cut in (15, 30, 47):
        assert _run(wider_model, cfg, params, cut) == want, f"cut after {cut} steps"


def test_saved_kv_must_hold_the_tokens_it_claims(wider_model: Path) -> None:
    engine = Engine.from_pretrained(wider_model, EngineConfig(num_blocks=64))
    kv = torch.zeros(4, 2, 1, 16, 2, 32)
    with pytest.raises(ValueError, match="do not fit"):
        engine.resume_from_kv("x", list(range(5, 40)), PARAMS, kv, RequestOptions(output_token_ids=(7,)), 20)
