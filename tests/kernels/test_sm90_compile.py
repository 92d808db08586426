"""Every triton kernel compiles for sm_90 (H100/H200) as its wrapper launches it, on this host:
the check that the interpreter cannot make (see tests/kernels/sm90_compile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90() -> None:
    triton = pytest.importorskip("triton", reason="triton not installed")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # 3.9's default, named to silence its warning
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = proc.stdout.splitlines()
    for name in ("_decode_kernel", "_merge_splits_kernel", "_prefill_kernel", "_write_kv_kernel",
                 "_int8_quant_kernel", "_int8_dequant_kernel", "_fp8_quant_kernel", "_fp8_dequant_kernel"):
        assert any(line.startswith(name) for line in compiled), f"{name} was not compiled"
