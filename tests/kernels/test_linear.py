"""kernels.linear equals F.linear on every path: the few-row float32 split-bmm one and the fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import linear
from kernels.linear import (
    ONEDNN_CACHE_ENTRIES,
    ONEDNN_CACHE_VARIABLES,
    SPLIT_MAX_ROWS,
    Linear,
    _split_bmm_applies,
    bound_onednn_caches,
    packing_available,
    prepack,
)
from transfer.units import MIB


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows: int, dtype: torch.dtype, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(130, 96, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype) if with_bias else None
    out = linear(x, w, b)
    want = F.linear(x, w, b)
    assert out.shape == want.shape and out.dtype == want.dtype and out.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol * 10, rtol=tol)


def test_split_path_taken_only_where_it_was_measured_faster() -> None:
    w = torch.randn(64, 32)
    assert _split_bmm_applies(torch.randn(1, 32), w)
    assert _split_bmm_applies(torch.randn(SPLIT_MAX_ROWS, 32), w)
    assert not _split_bmm_applies(torch.randn(SPLIT_MAX_ROWS + 1, 32), w)
    assert not _split_bmm_applies(torch.randn(1, 32, dtype=torch.bfloat16), w.bfloat16())
    assert not _split_bmm_applies(torch.randn(1, 32), torch.randn(63, 32))  # odd rows: no halves
    assert not _split_bmm_applies(torch.randn(1, 32), torch.randn(32, 64).t())  # not contiguous


needs_packing = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


@needs_packing
@pytest.mark.parametrize("rows", [1, 4, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_path_matches_f_linear(rows: int, dtype: torch.dtype, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(130, 96, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype) if with_bias else None
    packed = prepack(w)  # never raises: None where this CPU's oneDNN refuses the dtype
    if packed is None and dtype == torch.bfloat16:
        pytest.skip("this CPU's oneDNN cannot pack bfloat16 (needs AVX-512 or AVX-NE-CONVERT)")
    assert packed is not None and packed.dtype == dtype
    out = linear(x, w, b, packed)
    want = F.linear(x, w, b)
    assert out.shape == want.shape and out.dtype == want.dtype and out.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol * 10, rtol=tol)
    # a leading batch dimension, as nn.Linear takes
    torch.testing.assert_close(linear(x.view(1, rows, 96), w, b, packed).float(), want.view(1, rows, 130).float(),
                               atol=tol * 10, rtol=tol)


def test_prepack_declines_what_it_cannot_pack() -> None:
    assert prepack(torch.randn(8, 4, dtype=torch.float64)) is None
    assert prepack(torch.randn(2, 8, 4)) is None


@needs_packing
def test_linear_module_packs_and_drops_stale_copies() -> None:
    torch.manual_seed(0)
    m = Linear(32, 48, bias=True)
    x = torch.randn(5, 32)
    want = F.linear(x, m.weight, m.bias)
    assert m.packed is None and m.pack() and m.packed is not None
    assert "packed" not in m.state_dict() and len(list(m.parameters())) == 2
    with torch.inference_mode():
        torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)
    m.to(torch.bfloat16)  # recast: the float32 packed copy is stale and dropped
    assert m.packed is None
    torch.testing.assert_close(m(x.bfloat16()).float(), want, atol=0.1, rtol=0.05)
    m.pack()
    with torch.no_grad():
        m.weight.zero_()
    # a packed copy of a dtype other than the input's is ignored
    assert torch.count_nonzero(linear(x, m.weight.float(), None, m.packed)) == 0


def test_engine_model_packs_every_projection_and_load_weights_unpacks(tmp_path) -> None:
    from actors.engine.model import CausalLM
    from actors.engine.tiny_model import write_tiny_model
    from actors.engine.weights import load_weights

    loaded = load_weights(write_tiny_model(tmp_path / "tiny"))
    net = CausalLM(loaded.config)
    net.load_weights(loaded.tensors)
    linears = [m for m in net.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * loaded.config.num_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    assert net.pack_weights() == (len(linears) if packing_available() else 0)
    net.load_weights(loaded.tensors)
    assert all(m.packed is None for m in linears)


# Runs in a fresh interpreter: both caches read their capacity at the process's first oneDNN call.
_CACHE_PROBE = """
import ctypes, json, os, sys
import torch
from kernels.linear import bound_onednn_caches, linear, prepack
if sys.argv[1] == "engine":  # an engine bounds them as it starts
    import tempfile
    from actors.engine.engine import Engine
    from actors.engine.tiny_model import write_tiny_model
    Engine.from_pretrained(write_tiny_model(tempfile.mkdtemp()))
elif sys.argv[1] != "unset":
    bound_onednn_caches(int(sys.argv[1]))
torch.set_num_threads(1)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def in_use():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
weight = torch.randn(1536, 576, dtype=torch.bfloat16)
packed = prepack(weight)
linear(torch.randn(1, 576, dtype=torch.bfloat16), weight, None, packed)
before = in_use()
for rows in range(64, 264):  # a new row count per call, as prefill steps are
    linear(torch.randn(rows, 576, dtype=torch.bfloat16), weight, None, packed)
print(json.dumps({"growth": in_use() - before,
                  "env": {k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}}))
"""


def _cache_probe(entries: str, env: dict[str, str]) -> dict:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    clean = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    out = subprocess.run([sys.executable, "-c", _CACHE_PROBE, entries], env={**clean, **env}, check=True,
                         capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")
@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"), reason="needs glibc's mallinfo2")
def test_bounded_onednn_caches_stop_growing_with_new_shapes() -> None:
    """200 row counts never seen before: with oneDNN's defaults every one stays cached with its
    scratch memory; bounded at 8 entries, only the last few do; an engine bounds them at 128."""
    if prepack(torch.zeros(16, 16, dtype=torch.bfloat16)) is None:
        pytest.skip("this CPU's oneDNN cannot pack bfloat16: the probe's matmuls build no cached primitives")
    unbounded = _cache_probe("unset", {})
    bounded = _cache_probe("8", {})
    assert bounded["env"] == {name: "8" for name in ONEDNN_CACHE_VARIABLES}
    # What each cached primitive holds depends on the CPU's oneDNN path (with AVX512-BF16 or AMX tens of
    # MiB in all, ~8 MB where bf16 is emulated on AVX-512F): the check is that the defaults keep growing
    # with new shapes at all, and that the bound is what stops it.
    assert unbounded["growth"] > 2 * MIB, unbounded
    assert bounded["growth"] < unbounded["growth"] / 4, (bounded, unbounded)
    engine = _cache_probe("engine", {})
    assert engine["env"] == {name: str(ONEDNN_CACHE_ENTRIES) for name in ONEDNN_CACHE_VARIABLES}
    assert engine["growth"] < unbounded["growth"] * 0.75, (engine, unbounded)
    # an operator's own setting wins over the engine's default
    assert _cache_probe("8", {"LRU_CACHE_CAPACITY": "1024"})["env"]["LRU_CACHE_CAPACITY"] == "1024"


def test_bound_onednn_caches_keeps_set_values_and_rejects_nonsense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")  # so that teardown restores what was there
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert bound_onednn_caches(64) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "512"}
    with pytest.raises(ValueError, match=">= 1"):
        bound_onednn_caches(0)
