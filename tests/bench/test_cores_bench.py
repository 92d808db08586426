"""bench/cores.py end to end on a tiny random model: the baseline (split) and the one configuration
with its own code path (lent: the claim file; shared and spinning differ from split only by their
environment) run their engines in their own processes (the OpenMP wait policy only takes effect at
process start) and report positive figures, alone and together, with ratios against split."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from actors.engine.tiny_model import write_tiny_model
from bench import cores


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-cores"), seed=0)


@pytest.mark.slow
def test_split_and_lent_measure_both_engines(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cores.main(["--model", str(tiny_model_dir), "--seconds", "0.3", "--prompt-tokens", "32", "--rows", "2",
                       "--configs", "lent", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures["configs"]) == {"split", "lent"} and figures["cpus"] == len(os.sched_getaffinity(0))
    for row in figures["configs"].values():
        for key in ("alone_prefill_tok_s", "alone_decode_step_ms", "together_prefill_tok_s", "together_decode_step_ms"):
            assert row[key] > 0, (key, row)
    assert figures["configs"]["split"]["together_prefill_vs_split"] == 1.0
    assert "prefill tok/s together" in cores.render(figures)


def test_an_unknown_configuration_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cores.main(["--configs", "split,halves"])
    assert "unknown --configs ['halves']" in capsys.readouterr().err
