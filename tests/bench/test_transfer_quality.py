"""The quality part of bench/transfer.py (bench/transfer_quality.py): what its agreement counts, and its one-ulp floor."""

from __future__ import annotations

import pytest
import torch

from bench.transfer_quality import Agreement, one_ulp_off


def test_agreement_counts_ties_only_in_its_own_column() -> None:
    ref = torch.tensor([[1.0, 3.0, 3.0], [5.0, 1.0, 0.0], [0.0, 2.0, 1.0], [4.0, 0.0, 4.0]])
    logits = torch.tensor([[1.0, 2.0, 3.0],  # picks 2, which ref ties with its own pick 1
                           [5.0, 1.0, 0.0],  # same
                           [0.0, 1.0, 2.0],  # picks 2, a real flip
                           [4.0, 0.0, 4.0]])  # both tie 0 and 2 and pick 0: same
    a = Agreement()
    a.add(logits, ref)
    assert (a.steps, a.same, a.same_or_tied) == (4, 2, 3)
    assert a.max_logit_diff == 1.0
    assert a.kl_sum > 0
    a.add(ref, ref)
    assert (a.steps, a.same, a.same_or_tied) == (8, 6, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_ulp_off_moves_every_value_one_step(dtype: torch.dtype) -> None:
    kv = (torch.randn(2, 2, 1, 4, 3, 8, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    out = one_ulp_off(kv, seed=1)
    assert out.dtype == dtype
    up = torch.nextafter(kv, torch.full_like(kv, torch.inf))
    down = torch.nextafter(kv, torch.full_like(kv, -torch.inf))
    assert bool(((out == up) | (out == down)).all())
    assert 0.3 < float((out == up).float().mean()) < 0.7  # both directions
    assert torch.equal(out, one_ulp_off(kv, seed=1))
