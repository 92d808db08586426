"""bench/kernels.py and the prepared GPU check that runs it: on a CPU machine they must still run end to
end, say plainly that their figures are CPU reference timings, and leave the JSON a reader expects."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import kernels as kbench

ROOT = Path(__file__).resolve().parents[2]
DECODE_KEYS = {"batch", "context", "kv", "splits", "time_us", "GB_per_s", "of_copy_bw", "sdpa_us", "speedup_vs_sdpa"}


def _check_figures(figures: dict) -> None:
    assert figures["mode"] == "cpu-reference" and figures["copy_GB_per_s"] > 0
    assert figures["decode"] and all(set(r) == DECODE_KEYS and r["GB_per_s"] > 0 for r in figures["decode"])
    assert {r["kernel"] for r in figures["quant"]} == {"int8 quantize", "int8 dequantize", "fp8 quantize",
                                                       "fp8 dequantize"}


@pytest.mark.slow
def test_tables_and_json_out_carry_the_same_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if kbench.torch.cuda.is_available():
        pytest.skip("this checks the CPU path")
    out = tmp_path / "k.json"
    assert kbench.main(["--json-out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("CPU REFERENCE TIMINGS")  # never mistaken for GPU figures
    figures = json.loads(out.read_text())
    _check_figures(figures)
    for row in figures["decode"]:  # every measured row is in the table, as printed
        assert f"{row['time_us']:,.0f}" in printed


@pytest.mark.slow
def test_gpu_check_script_runs_every_step_and_fails_without_a_gpu(tmp_path: Path) -> None:
    if kbench.torch.cuda.is_available():
        pytest.skip("on a GPU this script is the GPU check itself: run it, do not test it")
    if shutil.which("timeout") is None:
        pytest.skip("coreutils' timeout is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable, PATH=env.get("PATH", ""),
               # Its pytest steps run only the dispatch tests here: the rest already ran in this suite.
               PYTEST_ADDOPTS="-k dispatch")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    if shutil.which("nvidia-smi") is None:  # the environment step fails, and so does the script...
        assert proc.returncode != 0, proc.stdout
    # ... but every step still ran and left its log and figures.
    for name in ("env", "tests", "bench"):
        assert (tmp_path / f"{name}.log").exists(), proc.stdout
        assert f"== {name}: exit" in proc.stdout
    assert " passed" in (tmp_path / "tests.log").read_text()
    _check_figures(json.loads((tmp_path / "kernels.json").read_text()))
