"""Compile every triton kernel, exactly as its wrapper launches it, for an H100/H200 (sm_90) on a
machine without a GPU: triton's frontend, the NVIDIA backend and its bundled ptxas run on the host.

Mental model: the interpreter proves the kernels' math, not that the real compiler accepts them
(it does not type-check constexpr branches, early returns or layouts the same way). So each wrapper
is called on small CPU tensors with the device check disabled and the kernel objects swapped for
recorders; every recorded launch is then compiled to a cubin and its shared memory checked against
the sm_90 limit. Run in a process without TRITON_INTERPRET: `python -m tests.kernels.sm90_compile`.
Prints one line per compiled kernel; exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

MAX_SHARED_BYTES = 232448  # 227 KiB, the largest shared memory one sm_90 block may use


class _Recorder:
    def __init__(self, kernel: Any, launches: list[tuple[Any, tuple, dict]]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def _record_launches() -> list[tuple[Any, tuple, dict]]:
    from kernels import triton_decode, triton_kv_write, triton_prefill, triton_quant, triton_validate
    from tests.kernels.paged_kv_data import make_batch

    launches: list[tuple[Any, tuple, dict]] = []
    for mod in (triton_decode, triton_kv_write, triton_prefill, triton_quant, triton_validate):
        if hasattr(mod, "check_device"):
            mod.check_device = lambda *tensors: None
        for name in dir(mod):
            if name.startswith("_") and name.endswith("_kernel"):
                setattr(mod, name, _Recorder(getattr(mod, name), launches))

    for dtype, int8 in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)):
        b = make_batch([37, 70], [1, 1], 32, 8, 128, 16, dtype, int8)
        triton_decode.paged_decode_attention_triton(
            b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 0.1, 70, b.k_scale,
            b.v_scale, num_splits=1 if int8 else 8)
        if dtype == torch.bfloat16:
            b = make_batch([37, 70], [20, 3], 32, 8, 128, 16, dtype, int8)
            triton_prefill.paged_prefill_attention_triton(
                b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 20,
                0.1, b.k_scale, b.v_scale, block_m=64, block_n=64)
            key = b.query[:, :8].contiguous()
            triton_kv_write.write_kv_triton(key, key, b.k_cache, b.v_cache,
                                            torch.arange(key.shape[0]), b.k_scale, b.v_scale)
    x = torch.randn(4, 16, 8, 128, dtype=torch.bfloat16)
    q, s = triton_quant.quantize_int8_triton(x)
    triton_quant.dequantize_int8_triton(torch.zeros_like(x, dtype=torch.int8), torch.zeros(x.shape[:-1]), torch.bfloat16)
    triton_quant.quantize_fp8_triton(x)
    triton_quant.dequantize_fp8_triton(torch.zeros_like(x, dtype=torch.float8_e4m3fn), torch.zeros(4), torch.bfloat16)
    return launches


def _signature(kernel: Any, args: tuple, kwargs: dict) -> tuple[dict[str, str], dict[str, Any]]:
    from triton.runtime.jit import mangle_type

    values = dict(zip([p.name for p in kernel.params], args)) | kwargs
    signature, constexprs = {}, {}
    for p in kernel.params:
        v = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", v
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        else:
            signature[p.name] = mangle_type(v)
    return signature, constexprs


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run without TRITON_INTERPRET", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for kernel, args, kwargs in _record_launches():
        signature, constexprs = _signature(kernel, args, kwargs)
        t0 = time.perf_counter()
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        shared = compiled.metadata.shared
        flags = {k: v for k, v in constexprs.items() if k in ("KV_INT8", "NUM_SPLITS", "DOT_PRECISION")}
        print(f"{kernel.__name__:<24} {flags} shared={shared}B cubin={len(compiled.asm['cubin'])}B "
              f"{time.perf_counter() - t0:.1f}s")
        if shared > MAX_SHARED_BYTES:
            print(f"{kernel.__name__}: {shared} bytes of shared memory > {MAX_SHARED_BYTES}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
