"""bench/moe.py end to end at toy sizes: every part reports, a swapped table never drops or mixes a
request and is used within one step, the unrestricted budget row is the exact reference."""

from __future__ import annotations

import json

import pytest

from bench import moe


@pytest.mark.slow
def test_every_part_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert moe.main(["--num-requests", "4", "--prompt-len", "16", "--output-len", "6", "--rounds", "3",
                     "--min-tokens", "32", "--quality-budgets", "0.9", "--num-swaps", "30", "--budgets", "2",
                     "--budget-experts", "8", "--budget-hidden", "64", "--repeats", "1", "--json"]) == 0
    f = json.loads(capsys.readouterr().out)
    swap = f["swap"]
    assert swap["completed_all_tokens"] == swap["replay_identical"] == swap["requests"] == 4
    assert swap["versions_used"] > 1 and swap["lag_steps_max"] == 0
    [row] = f["controller"]["rows"]
    assert row["imbalance_before"] >= 1.0 and row["imbalance_after"] >= 1.0 and 0 <= row["greedy_token_change"] <= 1
    assert 0 < f["controller"]["bf16_token_change"] < 1
    full, two = f["budget"]
    assert full["budget"] == "all" and full["greedy_agreement"] == 1.0 and full["kl_mean"] == 0.0
    assert two["budget"] == 2 and two["kl_mean"] > 0 and 1 <= two["distinct_experts_per_layer"] <= 8
    assert "yardstick" in moe.render(f) and "decode step ms" in moe.render(f)
