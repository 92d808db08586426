"""Speculative decoding on CUDA (issue 23; skipped without CUDA): on a random tiny Llama in float32,
with CUDA graphs on (plain decode steps replay them, verify steps do not), greedy and seeded outputs
are the same tokens with n-gram and early-exit speculation as without, every slot comes back, and
early exit at full depth (the model drafting itself) accepts every draft."""

from __future__ import annotations

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.sampling import SamplingParams
from actors.engine.spec import SpecConfig
from actors.engine.tiny_model import write_tiny_model

pytestmark = pytest.mark.gpu

SHAPE = {"vocab_size": 1024, "hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
         "intermediate_size": 512}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return write_tiny_model(tmp_path_factory.mktemp("spec-cuda"), seed=2, **SHAPE)


def _run(path, spec: SpecConfig, params: SamplingParams) -> tuple[list[tuple[int, ...]], Engine]:
    e = Engine.from_pretrained(path, EngineConfig(device="cuda", num_blocks=256, speculation=spec))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 1000, (n,), generator=g).tolist() * 2 for n in (17, 40, 96, 150)]
    outs = e.generate(prompts, params)
    e.check_integrity()
    assert e.kv.pool.num_free_blocks == e.num_blocks
    return [o.token_ids for o in outs], e


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=48, temperature=0.7, top_k=3, seed=5, ignore_eos=True)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("spec", [SpecConfig(method="ngram", policy="always"),
                                  SpecConfig(method="early_exit", exit_layer=2, policy="always"),
                                  SpecConfig(method="early_exit", exit_layer=99, policy="always")],
                         ids=["ngram", "early_exit", "full_depth"])
def test_same_tokens_on_cuda(model_dir, spec, params):
    want, _ = _run(model_dir, SpecConfig(), params)
    got, e = _run(model_dir, spec, params)
    assert got == want
    stats = e.stats()
    assert stats.num_spec_steps > 0
    if spec.exit_layer == 99 and params.is_greedy:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
