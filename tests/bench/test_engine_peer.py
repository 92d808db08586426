"""bench/engine.py --peer vllm: its table of ferry beside vLLM's CPU engine, and the reason shown
when vLLM is not installed (the figures themselves need vLLM's venv: bench/build_peers.sh vllm)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import engine, engine_runners


def test_the_peer_table_divides_ferry_by_vllm_per_phase() -> None:
    figures = {"config": {"prefill_tokens": 1024}, "dtypes": {"float32": {
        "ferry": {"prefill_tok_s": 600.0, "decode": {"1": {"tok_s": 20.0}, "16": {"tok_s": 160.0}}},
        "vllm": {"prefill_tok_s": {"512": 1.0, "1024": 400.0}, "decode_tok_s": {"1": 40.0, "16": 160.0}}}}}
    table = engine.peer_table(figures)[0]
    assert "1.50x" in table and "0.50x" in table and "1.00x" in table
    assert "prefill 1024" in table  # the length that was run (--prefill-tokens), vLLM's figure for it
    assert engine.peer_table({"dtypes": {"float32": {"ferry": {}}}}) == []  # no --peer: no table


def test_vllm_missing_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_runners, "VLLM_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    got = engine_runners.vllm_figures(tmp_path, "float32", [1], 8, 2, tmp_path)
    assert "build_peers.sh vllm" in got["error"]
    table = engine.peer_table({"dtypes": {"float32": {"ferry": {}, "vllm": got}}})[0]
    assert "vLLM unavailable" in table
