"""The CLI's workload builder (rate really holds), the knee rule and the RESULTS.md writer."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.loadgen.cli import add_arguments, apply_short_prompts, build_workload
from bench.loadgen.metrics import ClientRecord, Slo, summarize
from bench.loadgen.report import RatePoint, SystemResult, table, write_json, write_results_md


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_synthetic_workload_without_trace_and_tenants() -> None:
    reqs, desc = build_workload(_args("--trace", "none", "--arrivals", "gamma", "--burstiness", "0.5",
                                      "--num-requests", "30", "--tenants", "a,b,c"), 5.0)
    assert len(reqs) == 30 and {(r.prompt_len, r.output_len) for r in reqs} == {(128, 32)}
    assert [r.tenant for r in reqs[:4]] == ["a", "b", "c", "a"] and "gamma" in desc


def test_trace_prefix_is_scaled_to_the_rate_within_the_time_bound() -> None:
    try:
        reqs, _ = build_workload(_args("--duration", "30"), 3.0)
    except FileNotFoundError:
        pytest.skip("shared/traces not present")
    assert len(reqs) == 91 and reqs[-1].arrival_s == pytest.approx(30.0)
    # production lengths by default: prompts clipped to 1,024 and outputs to 128 tokens
    assert all(r.prompt_len <= 1024 and r.output_len <= 128 for r in reqs)
    assert sum(r.prompt_len for r in reqs) / len(reqs) > 500
    short = _args("--duration", "30", "--short-prompts")
    apply_short_prompts(short)
    reqs, desc = build_workload(short, 3.0)
    assert all(r.prompt_len + r.output_len <= 1024 and r.output_len <= 64 for r in reqs) and "x0.1" in desc
    assert sum(r.prompt_len for r in reqs) / len(reqs) < 300


def test_trace_start_skips_the_first_requests_and_starts_the_clock_at_the_first_kept() -> None:
    from bench.loadgen.workload import load_trace, resolve_trace

    try:
        whole = load_trace(resolve_trace("mooncake"), limit=3620)
    except FileNotFoundError:
        pytest.skip("shared/traces not present")
    reqs, desc = build_workload(_args("--trace", "mooncake", "--trace-start", "3600", "--duration", "30"), 0.5)
    assert len(reqs) == 16 and reqs[0].arrival_s == 0.0 and reqs[-1].arrival_s == pytest.approx(30.0)
    assert [r.hash_ids[0] for r in reqs] == [r.hash_ids[0] for r in whole[3600:3616]]
    assert "from request 3600" in desc


def _point(rate: float, good: int, sent: int) -> RatePoint:
    recs = [ClientRecord(send_s=0.0, chunk_s=[0.1 if i < good else 9.0], output_tokens=1, success=True)
            for i in range(sent)]
    return RatePoint.of(rate, summarize(recs, 10.0, {"default": Slo(ttft_ms=1000)}), recs)


def test_knee_is_the_highest_rate_meeting_the_target() -> None:
    r = SystemResult("x", [_point(1, 10, 10), _point(2, 19, 20), _point(4, 20, 40)])
    assert r.knee(0.9).rate_rps == 2
    only_bad = SystemResult("y", [_point(1, 5, 10), _point(2, 8, 20)])
    assert only_bad.knee(0.9).rate_rps == 2  # none meets it: the best goodput


def test_results_files(tmp_path: Path) -> None:
    results = [SystemResult("a", [_point(1, 10, 10)]), SystemResult("b", [_point(1, 5, 10)]),
               SystemResult("c", skipped="not built")]
    meta = {"machine": "m", "command": "ferry bench serve", "workload": "w", "slo": {}, "when": "now"}
    write_results_md(results, meta, 0.9, tmp_path / "R.md", ["a note"])
    text = (tmp_path / "R.md").read_text()
    assert "c: skipped: not built" in text and "- a note" in text
    row_b = next(line for line in text.splitlines() if line.startswith("b "))
    assert row_b.split()[-1] == "2.00"  # a's goodput / b's
    write_json(results, meta, tmp_path / "r.json")
    assert '"skipped": "not built"' in (tmp_path / "r.json").read_text()


def test_the_table_shows_each_knee_as_a_fraction_of_the_prefill_bound(tmp_path: Path) -> None:
    results = [SystemResult("a", [_point(1, 10, 10), _point(2, 19, 20)]), SystemResult("b", [_point(1, 5, 10)]),
               SystemResult("c", skipped="not built")]
    out = table(results, 0.9, bound_rps=4.0)
    lines = out.splitlines()
    assert "knee / prefill bound" in lines[0]
    assert lines[2].split()[-1] == "0.50"  # a's knee, 2 rps, of 4
    assert lines[3].split()[-1] == "-"  # b met no target
    bound = {"rps": 4.0, "prefill_tok_s": 4000.0, "dtype": "float32", "threads": 2, "prompt_tokens": 1000,
             "mean_prompt_tokens": 1000.0}
    meta = {"machine": "m", "command": "c", "workload": "w", "slo": {}, "when": "now", "prefill_bound": bound}
    write_results_md(results, meta, 0.9, tmp_path / "R.md", [])
    text = (tmp_path / "R.md").read_text()
    assert "prefill bound: 4.000 rps = 4000 prefill tokens/s" in text and "knee / prefill bound" in text


def test_every_rate_shows_the_workers_serving_at_its_end(tmp_path: Path) -> None:
    low, high = _point(1, 10, 10), _point(2, 19, 20)
    low.workers, high.workers = {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 2}
    meta = {"machine": "m", "command": "c", "workload": "w", "slo": {}, "when": "now"}
    write_results_md([SystemResult("a", [low, high])], meta, 0.9, tmp_path / "R.md", [])
    rows = [line.split() for line in (tmp_path / "R.md").read_text().splitlines() if line.startswith("a ")]
    assert [r[-1] for r in rows[-2:]] == ["1/1", "1/2"] and "workers P/D" in (tmp_path / "R.md").read_text()
    assert RatePoint.of(1.0, low.summary, [], workers={"colocated": 3}).worker_counts() == "colocated 3"
    write_json([SystemResult("a", [low, high])], meta, tmp_path / "r.json")
    assert '"decode": 2' in (tmp_path / "r.json").read_text()


def test_the_compute_bound_counts_decode_and_gets_its_own_column(tmp_path: Path) -> None:
    from bench.loadgen.bound import PrefillBound

    # 1,000-token prompts at 4,000 tok/s (0.25 s) + 100 output tokens at 200 tok/s (0.5 s): 1/0.75 rps
    b = PrefillBound(4000.0, 1000, 1000.0, "float32", 2, decode_tok_s=200.0, decode_rows=16,
                     mean_output_tokens=100.0)
    assert b.rps == 4.0 and abs(b.compute_rps - 1 / 0.75) < 1e-9
    assert PrefillBound(4000.0, 1000, 1000.0, "float32", 2).compute_rps is None
    assert "compute bound (prefill + decode): 1.333 rps" in b.describe()
    results = [SystemResult("a", [_point(1, 10, 10)])]
    lines = table(results, 0.9, bound_rps=b.rps, compute_rps=b.compute_rps).splitlines()
    assert lines[0].split()[-8:] == ["knee", "/", "prefill", "bound", "knee", "/", "compute", "bound"]
    assert lines[2].split()[-2:] == ["0.25", "0.75"]  # 1 rps of 4, and of 1.333
    meta = {"machine": "m", "command": "c", "workload": "w", "slo": {}, "when": "now", "prefill_bound": b.to_dict()}
    write_results_md(results, meta, 0.9, tmp_path / "R.md", [])
    text = (tmp_path / "R.md").read_text()
    assert "compute bound (prefill + decode): 1.333 rps" in text and "knee / compute bound" in text


def test_the_bounds_are_measured_on_a_real_engine(tmp_path: Path) -> None:
    from actors.engine.tiny_model import write_tiny_model
    from bench.loadgen.bound import measure_prefill_bound

    b = measure_prefill_bound(write_tiny_model(tmp_path, seed=0), "float32", 40.0, runs=1,
                              mean_output_tokens=20.0, decode_rows=3, decode_steps=4)
    assert b.prefill_tok_s > 0 and b.decode_tok_s and b.decode_tok_s > 0 and b.decode_rows == 3
    assert b.compute_rps is not None and b.compute_rps < b.rps


def test_the_compute_bound_times_decode_with_every_row_decoding(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Prompts prefill one after another (here 3 chunks of 16 tokens each), so the first row decodes
    # while the last prefills; a window opened when the last row starts must not see the first
    # ones finish, or "decode at 3 rows" is measured at fewer.
    from actors.engine.engine import Engine
    from actors.engine.tiny_model import write_tiny_model
    from bench.loadgen import bound

    rows_per_step: list[int] = []
    step = Engine.step

    def counting(self):  # type: ignore[no-untyped-def]
        outputs = step(self)
        rows_per_step.append(sum(1 for o in outputs if o.new_token_ids and o.request_id.startswith("bound-decode")))
        return outputs

    monkeypatch.setattr(Engine, "step", counting)
    monkeypatch.setattr(bound, "CHUNK_TOKENS", 16)
    b = bound.measure_prefill_bound(write_tiny_model(tmp_path, seed=0), "float32", 40.0, runs=1,
                                    mean_output_tokens=20.0, decode_rows=3, decode_steps=4)
    assert b.decode_tok_s and b.decode_tok_s > 0
    assert rows_per_step[-5:] == [3, 3, 3, 3, 3]  # the warm-up step and the 4 timed ones
