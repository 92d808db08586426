"""Trace parsing (both formats), scaling, prefix synthesis, arrival processes, loopback guard."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.loadgen.arrivals import arrival_times, synthetic_workload
from bench.loadgen.client import NotLoopback, check_loopback
from bench.loadgen.prompts import block_words, prompt_text, prompt_words
from bench.loadgen.workload import (BenchRequest, assign_tenants, load_azure, load_mooncake, load_trace,
                                    rescale_rate, scale_lengths)

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,10,1
"""
MOONCAKE = """{"timestamp": 1000, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1, 2]}
{"timestamp": 500, "input_length": 700, "output_length": 4, "hash_ids": [0, 5]}

{"timestamp": 2500, "input_length": 100, "output_length": 9, "hash_ids": [7]}
"""


def test_azure_csv(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text(AZURE)
    reqs = load_trace(p)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(374, 44), (396, 109), (10, 1)]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 4.314579, 4.31941])
    assert load_azure(p, limit=2)[-1].output_len == 109


def test_mooncake_jsonl_sorted_from_zero(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text(MOONCAKE)
    reqs = load_mooncake(p)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 2.0]
    assert [r.hash_ids for r in reqs] == [(0, 5), (0, 1, 2), (7,)]
    assert reqs[1].prompt_len == 1100 and reqs[1].output_len == 6


@pytest.mark.parametrize("name", ["azure", "mooncake"])
def test_real_traces_parse_when_present(name: str) -> None:
    from bench.loadgen.workload import resolve_trace
    try:
        path = resolve_trace(name)
    except FileNotFoundError:
        pytest.skip("shared/traces not present")
    reqs = load_trace(path, limit=200)
    assert len(reqs) == 200 and reqs[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))


def test_length_scaling_keeps_shape_and_clips() -> None:
    reqs = [BenchRequest(0.0, 1000, 100, hash_ids=(1, 2)), BenchRequest(1.0, 20000, 400, hash_ids=tuple(range(40)))]
    out = scale_lengths(reqs, 0.1, max_model_len=512)
    assert (out[0].prompt_len, out[0].output_len, out[0].block_tokens) == (100, 10, 51)
    assert out[1].output_len == 40 and out[1].prompt_len == 512 - 40  # clipped to the context
    assert out[1].hash_ids == tuple(range(10))  # ceil(472 / 51) blocks still start in the prompt


def test_rate_rescaling() -> None:
    reqs = [BenchRequest(float(t), 1, 1) for t in range(11)]  # 1 rps
    out = rescale_rate(reqs, 4.0)
    assert out[-1].arrival_s == pytest.approx(2.5)


def test_equal_hash_ids_give_equal_token_blocks() -> None:
    a = BenchRequest(0.0, 30, 1, hash_ids=(3, 4, 9), block_tokens=10)
    b = BenchRequest(0.0, 25, 1, hash_ids=(3, 4, 8), block_tokens=10)
    wa, wb = prompt_words(a, 0), prompt_words(b, 1)
    assert wa[:20] == wb[:20] and wa[20:25] != wb[20:25]
    assert prompt_text(a, 0).startswith(prompt_text(BenchRequest(0.0, 20, 1, (3, 4), 10), 7))
    assert block_words(3, 10) == block_words(3, 10) != block_words(4, 10)
    assert len(wa) == 30 and len(wb) == 25


def test_prompts_without_hash_ids_do_not_share_a_prefix() -> None:
    r = BenchRequest(0.0, 40, 1)
    assert prompt_words(r, 0)[:8] != prompt_words(r, 1)[:8]
    assert prompt_words(r, 0) == prompt_words(r, 0)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrival_mean_rate_within_5_percent(burstiness: float) -> None:
    times = arrival_times(20000, rate_rps=8.0, burstiness=burstiness, seed=1)
    rate = (len(times) - 1) / times[-1]
    assert abs(rate - 8.0) / 8.0 < 0.05
    gaps = np.diff(times)
    cv2 = gaps.var() / gaps.mean() ** 2  # squared coefficient of variation = 1 / shape
    assert cv2 == pytest.approx(1.0 / burstiness, rel=0.1)


def test_synthetic_workload_samples_lengths_and_tenants() -> None:
    pool = [BenchRequest(0.0, 5, 2), BenchRequest(0.0, 7, 3)]
    reqs = synthetic_workload(50, 10.0, 1.0, seed=3, lengths=pool)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(5, 2), (7, 3)}
    t = assign_tenants(reqs, ["x", "y"], ["interactive", "batch"])
    assert [(r.tenant, r.slo_class) for r in t[:3]] == [("x", "interactive"), ("y", "batch"), ("x", "interactive")]


def test_loopback_guard() -> None:
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:1/v1")
    with pytest.raises(NotLoopback):
        check_loopback("http://10.1.2.3:8000")
    with pytest.raises(NotLoopback):
        check_loopback("http://8.8.8.8/v1")


def test_blocks_are_real_token_blocks_in_smollm2_when_cached() -> None:
    gguf = Path.home() / ".cache" / "ferry" / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        pytest.skip("SmolLM2 GGUF not cached")
    from actors.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf)
    a = BenchRequest(0.0, 60, 1, hash_ids=(3, 4, 9), block_tokens=20)
    b = BenchRequest(0.0, 60, 1, hash_ids=(3, 4, 8), block_tokens=20)
    ta, tb = tok.encode(prompt_text(a, 0)), tok.encode(prompt_text(b, 1))
    assert len(ta) == len(tb) == 60  # one token per word
    assert ta[:40] == tb[:40] and ta[40:] != tb[40:]
