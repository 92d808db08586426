"""Kernel benchmark: paged decode attention and the KV quantizers, against the memory system.

Mental model: decode attention and (de)quantization are memory-bound, so the figure of merit is
achieved bandwidth (bytes the kernel must read and write / time) next to what a plain large copy
achieves on the same device in the same run. Decode is also timed against torch's
scaled_dot_product_attention on the same KV gathered into dense [B, Hkv, L, D] tensors (SDPA alone
is timed, not the gather), which is what a non-paged engine would run.
- CUDA (and triton): decode at batch 1/32/128 x context 1k/8k/32k, 32 query / 8 KV heads, head dim
  128, bf16, block 16 (int8 KV on some shapes), timed with triton.testing.do_bench; shapes that do
  not fit in free memory are skipped; the quantizers on 1 GiB of bf16 KV.
- otherwise: the torch reference path (the engine's CPU path) on small shapes, beside a numpy
  memcpy, clearly labelled CPU reference timings.
Target (issue 19, CUDA only): paged decode attention at batch 32 x context 8192, bf16 KV (1 GiB of
KV, a heavy decode step) reaches >= 70% of the device copy bandwidth; `targets` in the JSON holds
it with pass/fail, and `decode_summary` the spread over every bf16 shape with >= 256 MiB of KV.
Usage: python bench/kernels.py [--json] [--json-out FILE]. Tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/kernels.py` from anywhere

from kernels import quant  # noqa: E402
from kernels.reference import paged_decode_attention_ref  # noqa: E402
from kernels.triton_support import use_triton  # noqa: E402

GB = 1e9
HQ, HKV, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE_BATCHES, DECODE_CONTEXTS = (1, 32, 128), (1024, 8192, 32768)
COPY_BYTES = 4 << 30  # the device copy that sets the bandwidth ceiling
QUANT_BLOCKS = 32768  # blocks of [BLOCK, HKV, HEAD_DIM] bf16 quantized: 1 GiB
TARGET_SHAPE = (32, 8192, "bf16")  # (batch, context, kv) of the decode row the target reads
TARGET_MIN_OF_COPY_BW = 0.7
SUMMARY_MIN_KV_BYTES = 256 << 20  # smaller decode shapes are launch-bound, not bandwidth-bound


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _paged_kv(batch: int, ctx: int, kv_int8: bool, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Uniform-length batch over shuffled blocks, built on the device."""
    nb = ctx // BLOCK
    gen = torch.Generator(device=device).manual_seed(0)
    table = torch.randperm(batch * nb, device=device, generator=gen).view(batch, nb).to(torch.int32)
    shape = (batch * nb, BLOCK, HKV, HEAD_DIM)
    kv: dict[str, Any] = {"block_tables": table, "k_scale": None, "v_scale": None,
                          "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device=device),
                          "query": torch.randn(batch, HQ, HEAD_DIM, device=device, dtype=dtype, generator=gen)}
    for name in ("k", "v"):
        if kv_int8:
            kv[f"{name}_cache"] = torch.randint(-127, 128, shape, device=device, dtype=torch.int8, generator=gen)
            kv[f"{name}_scale"] = torch.rand(shape[:3], device=device, generator=gen) / 64
        else:
            kv[f"{name}_cache"] = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    return kv


def _decode_bytes(batch: int, ctx: int, kv_int8: bool, elem: int) -> int:
    per_token = 2 * HKV * (HEAD_DIM * (1 if kv_int8 else elem) + (4 if kv_int8 else 0))  # K+V(+scales)
    return batch * ctx * per_token + 2 * batch * HQ * HEAD_DIM * elem  # + query read, output write


def _gpu_bench(fn: Callable[[], Any]) -> float:
    """Median seconds of fn on the GPU (CUDA events inside do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")) / 1e3


def run_cuda(dev: str = "cuda") -> dict[str, Any]:
    import torch.nn.functional as F

    from kernels.triton_decode import choose_num_splits, paged_decode_attention_triton
    from kernels.triton_quant import (
        dequantize_fp8_triton, dequantize_int8_triton, quantize_fp8_triton, quantize_int8_triton,
    )

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_s = _gpu_bench(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() / copy_s  # bytes read + written per second
    del src, dst
    _progress(f"device copy: {copy_bw / GB:.0f} GB/s (read + write)")
    rows = []
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            for kv_int8 in (False, True) if batch == 32 or ctx == DECODE_CONTEXTS[-1] else (False,):
                elem = 2
                kv_bytes = batch * ctx * 2 * HKV * HEAD_DIM * (1 if kv_int8 else elem)
                need = kv_bytes + batch * ctx * 2 * HKV * HEAD_DIM * elem  # paged + dense bf16 copy
                if need > 0.8 * torch.cuda.mem_get_info()[0]:
                    _progress(f"skip batch {batch} ctx {ctx}: needs {need / GB:.1f} GB")
                    continue
                kv = _paged_kv(batch, ctx, kv_int8, dev, torch.bfloat16)
                splits = choose_num_splits(batch * HKV, -(-ctx // 64), torch.device(dev))
                t = _gpu_bench(lambda: paged_decode_attention_triton(
                    kv["query"], kv["k_cache"], kv["v_cache"], kv["block_tables"], kv["seq_lens"],
                    HEAD_DIM**-0.5, ctx, kv["k_scale"], kv["v_scale"]))
                row = {"batch": batch, "context": ctx, "kv": "int8" if kv_int8 else "bf16",
                       "splits": splits, "time_us": t * 1e6,
                       "GB_per_s": _decode_bytes(batch, ctx, kv_int8, elem) / t / GB}
                row["of_copy_bw"] = row["GB_per_s"] * GB / copy_bw
                row["sdpa_us"] = row["speedup_vs_sdpa"] = None
                if not kv_int8:  # SDPA on the same bf16 KV, gathered dense once, outside the timing
                    dense = [kv[f"{n}_cache"][kv["block_tables"].long()].view(batch, ctx, HKV, HEAD_DIM)
                             .transpose(1, 2).contiguous() for n in ("k", "v")]
                    q4 = kv["query"].unsqueeze(2)  # [B, Hq, 1, D]
                    try:
                        ts = _gpu_bench(lambda: F.scaled_dot_product_attention(
                            q4, dense[0], dense[1], scale=HEAD_DIM**-0.5, enable_gqa=True))
                        row["sdpa_us"], row["speedup_vs_sdpa"] = ts * 1e6, ts / t
                    except (torch.cuda.OutOfMemoryError, TypeError, RuntimeError) as e:
                        # TypeError: a torch without enable_gqa; RuntimeError: no backend for it
                        _progress(f"SDPA skipped at batch {batch} ctx {ctx}: {type(e).__name__}: {e}")
                    del dense
                rows.append(row)
                _progress(f"decode {row}")
                del kv
                torch.cuda.empty_cache()
    x = torch.randn(QUANT_BLOCKS, BLOCK, HKV, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    n = x.numel()
    q8, s8 = quantize_int8_triton(x)
    f8, sf = quantize_fp8_triton(x)
    cases = [
        ("int8 quantize", lambda: quantize_int8_triton(x), 2 * n + n + 4 * n // HEAD_DIM),
        ("int8 dequantize", lambda: dequantize_int8_triton(q8, s8, torch.bfloat16), n + 4 * n // HEAD_DIM + 2 * n),
        ("fp8 quantize", lambda: quantize_fp8_triton(x), 2 * n + n + 4 * x.shape[0]),
        ("fp8 dequantize", lambda: dequantize_fp8_triton(f8, sf, torch.bfloat16), n + 2 * n),
    ]
    quant_rows = []
    for name, fn, nbytes in cases:
        t = _gpu_bench(fn)
        quant_rows.append({"kernel": name, "MiB_in": x.numel() * 2 / 2**20, "time_us": t * 1e6,
                           "GB_per_s": nbytes / t / GB, "of_copy_bw": nbytes / t / copy_bw})
    return {"mode": "cuda", "device": torch.cuda.get_device_name(), "copy_GB_per_s": copy_bw / GB,
            "decode": rows, "quant": quant_rows, **decode_targets(rows)}


def decode_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`targets` (the issue's decode target, pass/fail; value None when its shape was skipped) and
    `decode_summary` (fraction of copy bandwidth over the bandwidth-bound bf16 shapes)."""
    at = [r for r in rows if (r["batch"], r["context"], r["kv"]) == TARGET_SHAPE]
    value = at[0]["of_copy_bw"] if at else None
    target = {"shape": {"batch": TARGET_SHAPE[0], "context": TARGET_SHAPE[1], "kv": TARGET_SHAPE[2]},
              "min": TARGET_MIN_OF_COPY_BW, "value": value,
              "met": value is not None and value >= TARGET_MIN_OF_COPY_BW}
    big = [r["of_copy_bw"] for r in rows
           if r["kv"] == "bf16" and r["batch"] * r["context"] * 2 * HKV * HEAD_DIM * 2 >= SUMMARY_MIN_KV_BYTES]
    summary = {"min_kv_bytes": SUMMARY_MIN_KV_BYTES, "num_shapes": len(big),
               "min_of_copy_bw": min(big, default=None), "max_of_copy_bw": max(big, default=None)}
    return {"targets": {"decode_attention_of_copy_bw": target}, "decode_summary": summary}


def _cpu_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run_cpu() -> dict[str, Any]:
    a = np.ones(64 << 20, dtype=np.float32)  # 256 MiB
    b = np.empty_like(a)
    copy_bw = 2 * a.nbytes / _cpu_time(lambda: np.copyto(b, a))
    del a, b
    _progress(f"numpy memcpy: {copy_bw / GB:.1f} GB/s (read + write)")
    rows = []
    for batch in (1, 8):
        for ctx in (256, 1024):
            for kv_int8 in (False, True):
                kv = _paged_kv(batch, ctx, kv_int8, "cpu", torch.float32)
                t = _cpu_time(lambda: paged_decode_attention_ref(
                    kv["query"], kv["k_cache"], kv["v_cache"], kv["block_tables"], kv["seq_lens"],
                    HEAD_DIM**-0.5, ctx, kv["k_scale"], kv["v_scale"]))
                gbs = _decode_bytes(batch, ctx, kv_int8, 4) / t / GB
                rows.append({"batch": batch, "context": ctx, "kv": "int8" if kv_int8 else "fp32",
                             "splits": None, "time_us": t * 1e6, "GB_per_s": gbs,
                             "of_copy_bw": gbs * GB / copy_bw, "sdpa_us": None, "speedup_vs_sdpa": None})
    x = torch.randn(512, BLOCK, HKV, HEAD_DIM)  # 32 MiB of float32 KV
    n = x.numel()
    q8, s8 = quant.quantize_int8_ref(x)
    f8, sf = quant.quantize_fp8_ref(x)
    cases = [
        ("int8 quantize", lambda: quant.quantize_int8_ref(x), 4 * n + n + 4 * n // HEAD_DIM),
        ("int8 dequantize", lambda: quant.dequantize_int8_ref(q8, s8), n + 4 * n // HEAD_DIM + 4 * n),
        ("fp8 quantize", lambda: quant.quantize_fp8_ref(x), 4 * n + n + 4 * x.shape[0]),
        ("fp8 dequantize", lambda: quant.dequantize_fp8_ref(f8, sf), n + 4 * n),
    ]
    quant_rows = []
    for name, fn, nbytes in cases:
        t = _cpu_time(fn)
        quant_rows.append({"kernel": name, "MiB_in": x.numel() * 4 / 2**20, "time_us": t * 1e6,
                           "GB_per_s": nbytes / t / GB, "of_copy_bw": nbytes / t / copy_bw})
    return {"mode": "cpu-reference", "device": "cpu", "copy_GB_per_s": copy_bw / GB,
            "decode": rows, "quant": quant_rows}


def _table(rows: list[dict[str, Any]]) -> str:
    headers = list(rows[0])

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 10 else f"{v:,.0f}"
        return str(v)

    cells = [[cell(r[h]) for h in headers] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--json-out", type=Path, metavar="FILE",
                        help="also write the figures as JSON to FILE (the tables still print)")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and use_triton(torch.empty(0, device="cuda"))
    figures = run_cuda() if on_gpu else run_cpu()
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(figures, indent=2) + "\n")
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    if on_gpu:
        print(f"Triton kernels on {figures['device']}; device copy {figures['copy_GB_per_s']:.0f} GB/s "
              f"(read + write); heads {HQ}q/{HKV}kv, head dim {HEAD_DIM}, block {BLOCK}")
    else:
        print(f"CPU REFERENCE TIMINGS (torch references, no triton, not GPU kernels); numpy memcpy "
              f"{figures['copy_GB_per_s']:.1f} GB/s (read + write); heads {HQ}q/{HKV}kv, "
              f"head dim {HEAD_DIM}, block {BLOCK}")
    print("\nPaged decode attention (GB_per_s = KV + Q bytes read, output written / time)")
    print(_table(figures["decode"]))
    print("\nKV quantization (bytes read + written / time)")
    print(_table(figures["quant"]))
    for name, t in figures.get("targets", {}).items():
        value = "not measured" if t["value"] is None else f"{100 * t['value']:.0f}%"
        shape = t["shape"]
        print(f"\nTarget {name} (batch {shape['batch']}, context {shape['context']}, {shape['kv']} KV): "
              f"{value} of copy bandwidth, >= {100 * t['min']:.0f}%: {'met' if t['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
