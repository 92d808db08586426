"""bench/moe.py end to end at toy sizes: every part reports, a swapped table never drops or mixes a
request and is used within one step, the unrestricted budget row is the exact reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import moe
from bench.moe_model import calibrate_head, margin_stats, next_token_argmax, skewed_moe_engine, text_prompts, text_slices


def test_margin_stats_are_scale_free_and_see_ties() -> None:
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(50, 64, generator=g)]
    logits[0][:10, 3:5] = 10.0  # ten exact ties
    a, b = margin_stats(logits), margin_stats([7 * logits[0]])
    assert a["median_z_margin"] == pytest.approx(b["median_z_margin"])
    assert a["near_tie_share"] >= 0.2 and a["p10_z_margin"] == pytest.approx(0.0, abs=1e-9)
    assert b["median_top1_prob"] > a["median_top1_prob"]  # sharper logits, same margins in std units
    assert [len(s) for s in text_slices(list(range(100)), 4, 40)] == [40] * 4


@pytest.mark.slow
def test_calibrated_head_hits_the_target_margin(tmp_path: Path) -> None:
    engine, control = skewed_moe_engine(tmp_path, num_experts=4, top_k=2, hidden=32, intermediate=64)
    fit = text_prompts(8, 24, seed=5)
    out = calibrate_head(engine, control, fit, target_median_z=0.6, seed=0)
    got = margin_stats(next_token_argmax(engine, control, fit, with_logits=True))["median_z_margin"]
    assert out["raw_median_z_margin"] < 0.5 and out["strength"] > 0
    assert got == pytest.approx(0.6, abs=0.02)


@pytest.mark.slow
def test_every_part_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert moe.main(["--num-requests", "4", "--prompt-len", "16", "--output-len", "6", "--rounds", "3",
                     "--min-tokens", "32", "--quality-budgets", "0.9", "--num-swaps", "30", "--budgets", "2",
                     "--budget-experts", "8", "--budget-hidden", "64", "--repeats", "1", "--calibrate-to", "1.0",
                     "--json"]) == 0
    f = json.loads(capsys.readouterr().out)
    swap = f["swap"]
    assert swap["completed_all_tokens"] == swap["replay_identical"] == swap["requests"] == 4
    assert swap["versions_used"] > 1 and swap["lag_steps_max"] == 0
    [row] = f["controller"]["rows"]
    assert len(row["rows_moved"]) == 2 and all(0 <= m <= 1 for m in row["rows_moved"])
    assert row["imbalance_before"] >= 1.0 and row["imbalance_after"] >= 1.0 and 0 <= row["greedy_token_change"] <= 1
    assert 0 < f["controller"]["bf16_token_change"] < 1
    cal = f["controller"]["calibration"]
    assert cal["real"] is None and cal["strength"] > 0 and cal["target_median_z_margin"] == 1.0
    assert cal["raw"]["median_z_margin"] < cal["calibrated"]["median_z_margin"]
    full, two = f["budget"]
    assert full["budget"] == "all" and full["greedy_agreement"] == 1.0 and full["kl_mean"] == 0.0
    assert two["budget"] == 2 and two["kl_mean"] > 0 and 1 <= two["distinct_experts_per_layer"] <= 8
    assert "yardstick" in moe.render(f) and "decode step ms" in moe.render(f)
