"""KV transfer benchmark: transport GB/s against this machine's limits, codec cost, and the quality
price of compressed KV on SmolLM2. One run, one table per part; `--json` prints the same figures.

Throughput is a round trip, the same for every row: the sender starts with the bytes in its memory
and stops the clock when the receiver says it has them in its own (preallocated) buffer. `memcpy` is
one copy in one process; `shm` copies into a shared segment, signals over a pipe, and the receiver
copies out and acks: the limits a transport between two processes on one machine works against.
`--transport cuda_ipc` is the same-node table alone: a receiver process (spawned: no Ray, no NIXL,
so it runs on the GPU check machine) owns a cuda_ipc arena on the device, the sender `send`s bytes
already on its GPU, against one device-to-device copy of the same bytes in one process (with
`--device cpu` both are host memory). Quality (`bench/transfer_quality.py`): greedy tokens decoded from KV shipped through each codec,
against the uncompressed reference, with the 1-ulp floor beside them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing import shared_memory
from typing import Any

# Run as `python bench/transfer.py`, this file's folder comes first on sys.path and its own name
# would shadow the `transfer` package it measures.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import bench_parser, best_s, format_table, gb_per_s, run  # noqa: E402
from bench.common import progress as log  # noqa: E402
from bench.transfer_quality import quality  # noqa: E402
from transfer.codec import Compression, KVLayout, decode_shard, encode  # noqa: E402
from transfer.units import MIB  # noqa: E402
# transfer.nixl imports the nixl package only inside NixlTransport and nixl_available: this file runs
# where nixl (or Ray, imported in object_store) is missing.
from transfer.nixl import NixlConfig, NixlTransport, nixl_available  # noqa: E402

# ---------------------------------------------------------------------------------- transports
def payload(size: int) -> np.ndarray:
    """The bytes every row sends: seeded random, so no transport or page cache gets them for free."""
    return np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)


def _endpoint(kind: str, name: str, send_bytes: int, recv_bytes: int, device: str) -> Any:
    """A nixl or cuda_ipc transport (its arena on `device`) with these staging sizes."""
    if kind == "nixl":
        return NixlTransport(name, NixlConfig(send_staging_bytes=send_bytes, recv_staging_bytes=recv_bytes))
    from transfer.cuda_ipc import CudaIpcConfig, CudaIpcTransport

    return CudaIpcTransport(name, CudaIpcConfig(recv_staging_bytes=recv_bytes, device=device))


def _receiver(kind: str, max_size: int, conn: Any, device: str) -> None:
    """Child process: receives each message (shm and nixl: into a preallocated host buffer) and acks it."""
    dst = np.ones(max_size if kind != "cuda_ipc" else 0, dtype=np.uint8)  # written, so its pages are resident
    if kind == "shm":
        seg = shared_memory.SharedMemory(name=conn.recv())
        src = np.ndarray((max_size,), dtype=np.uint8, buffer=seg.buf)
        while (n := int.from_bytes(conn.recv_bytes(), "little")) > 0:
            dst[:n] = src[:n]
            conn.send_bytes(b"k")
        del src
        seg.close()
        return
    t = _endpoint(kind, "bench-rx", MIB, max_size + MIB, device)
    conn.send_bytes(t.metadata())
    while conn.recv_bytes() == b"go":
        with t.recv(60.0) as d:
            assert len(d.data) > 0
            if kind == "nixl":  # cuda_ipc: the bytes stay in the arena on the receiver's GPU
                dst[: len(d.data)] = np.frombuffer(d.data, dtype=np.uint8)
        conn.send_bytes(b"k")
    t.close()


def two_process(kind: str, sizes: list[int], device: str = "cpu", src: Any = None) -> dict[int, float]:
    """Round trips of `src` (default `payload`) to a spawned receiver over shm, nixl or cuda_ipc."""
    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(kind, max(sizes), child_end, device), daemon=True)
    proc.start()
    src = payload(max(sizes)) if src is None else src
    out: dict[int, float] = {}
    try:
        if kind == "shm":
            seg = shared_memory.SharedMemory(create=True, size=max(sizes))
            buf = np.ndarray((max(sizes),), dtype=np.uint8, buffer=seg.buf)
            conn.send(seg.name)
            for size in sizes:
                def once(size: int = size) -> None:
                    buf[:size] = src[:size]
                    conn.send_bytes(size.to_bytes(8, "little"))
                    assert conn.poll(60) and conn.recv_bytes() == b"k"
                out[size] = gb_per_s(size, once)
            conn.send_bytes((0).to_bytes(8, "little"))
            del buf
            seg.close()
            seg.unlink()
            return out
        t = _endpoint(kind, "bench-tx", max(sizes) + MIB, MIB, device)
        try:
            if not conn.poll(120):
                raise RuntimeError(f"the {kind} receiver did not start within 120 s")
            t.add_peer(conn.recv_bytes())
            for size in sizes:
                def send(size: int = size) -> None:
                    conn.send_bytes(b"go")
                    t.send("bench-rx", [src[:size]], timeout_s=60.0)
                    assert conn.poll(60) and conn.recv_bytes() == b"k"
                out[size] = gb_per_s(size, send)
            conn.send_bytes(b"stop")
        finally:
            t.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


def object_store(sizes: list[int]) -> dict[int, float]:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # bind 127.0.0.1 only (NOTES-ray.md)
    import ray

    from transfer.object_store import ObjectStoreTransport

    class Rx:
        def __init__(self, max_size: int) -> None:
            self.t = ObjectStoreTransport("bench-rx", max_size + MIB)
            self.dst = np.ones(max_size, dtype=np.uint8)

        def metadata(self) -> bytes:
            return self.t.metadata()

        def take(self) -> int:
            with self.t.recv(60.0) as d:
                self.dst[: len(d.data)] = np.frombuffer(d.data, dtype=np.uint8)
                return len(d.data)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        tx = ObjectStoreTransport("bench-tx", MIB)
        rx = ray.remote(num_cpus=0.5)(Rx).remote(max(sizes))
        tx.add_peer(ray.get(rx.metadata.remote(), timeout=120))
        src = payload(max(sizes))
        out = {}
        for size in sizes:
            def once(size: int = size) -> None:
                taken = rx.take.remote()
                tx.send("bench-rx", [src[:size]], timeout_s=60.0)
                assert ray.get(taken, timeout=60) == size
            out[size] = gb_per_s(size, once)
        tx.close()
        return out
    finally:
        ray.shutdown()


def local(sizes: list[int]) -> dict[int, float]:
    """The in-process transport, sender and receiver on one thread (it copies on send)."""
    from transfer.local import LocalTransport

    tx, rx = LocalTransport("bench-local-tx"), LocalTransport("bench-local-rx", max(sizes) + MIB)
    tx.add_peer(rx.metadata())
    src = payload(max(sizes))
    dst = np.ones_like(src)

    def once(size: int) -> None:
        tx.send("bench-local-rx", [src[:size]], timeout_s=60.0)
        with rx.recv(60.0) as d:
            dst[:size] = np.frombuffer(d.data, dtype=np.uint8)

    try:
        return {size: gb_per_s(size, lambda size=size: once(size)) for size in sizes}
    finally:
        tx.close()
        rx.close()


def memcpy(sizes: list[int]) -> dict[int, float]:
    src = payload(max(sizes))
    dst = np.ones_like(src)
    return {size: gb_per_s(size, lambda size=size: np.copyto(dst[:size], src[:size])) for size in sizes}


def cuda_ipc_figures(sizes: list[int], device: str) -> dict[str, dict[int, float]]:
    """cuda_ipc between two processes (spawned, no Ray, no NIXL) against one device-to-device copy
    of the same bytes in one process. The clock runs from the sender's `send` of bytes already on
    its GPU until the receiver holds the Delivery (bytes in its arena on its GPU) and says so.
    With device "cpu" both rows are host memory (the shared-memory arena, and a memcpy)."""
    src = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    src = src.to(device)
    dst = torch.ones_like(src)

    def sync() -> None:
        if src.is_cuda:
            torch.cuda.synchronize(src.device)

    def copy(size: int) -> None:
        dst[:size].copy_(src[:size])
        sync()

    return {"d2d copy (1 process)": {size: gb_per_s(size, lambda size=size: copy(size)) for size in sizes},
            "cuda_ipc (2 processes)": two_process("cuda_ipc", sizes, device, src)}


# ---------------------------------------------------------------------------------- codec
def codec_figures(num_blocks: int) -> list[dict[str, Any]]:
    """SmolLM2's KV shape (30 layers, 3 KV heads, head_dim 64, 16-token blocks) in bf16."""
    layout = KVLayout("smollm2", 30, 3, 64, 16)
    kv = (torch.randn(30, 2, num_blocks, 16, 3, 64, generator=torch.Generator().manual_seed(0)) * 2).bfloat16()
    raw = kv.numel() * kv.element_size()
    rows = []
    for c in Compression:
        enc_s, shards = best_s(lambda c=c: encode(kv, layout, compression=c, num_shards=4))
        dec_s, _ = best_s(lambda shards=shards: [decode_shard(s, layout).kv.contiguous() for s in shards])
        rows.append({"codec": c.name.lower(), "raw_mib": raw / MIB, "wire_mib": sum(map(len, shards)) / MIB,
                     "ratio_vs_bf16": sum(map(len, shards)) / raw, "encode_gbps": raw / enc_s / 1e9,
                     "decode_gbps": raw / dec_s / 1e9})
    return rows


def write_quality(path: str, by_dtype: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """The lossy codecs' greedy agreement and logprob drift, per dtype, as `ferry status` reads them."""
    doc = {"model": "smollm2", "measured": time.strftime("%Y-%m-%d"), "prompts": args.prompts, "tokens": args.tokens,
           "prompt_tokens": args.prompt_tokens or "short",
           "command": f"python bench/transfer.py --parts quality --prompts {args.prompts} --tokens {args.tokens}"
                      f" --dtypes {args.dtypes} --write-quality {path}",
           "codecs": {dtype: {r["variant"]: {k: r[k] for k in ("forced_agreement", "free_agreement",
                                                                "prompts_identical", "mean_kl", "max_logit_diff")}
                              for r in rows if r["variant"] in ("none", "int8", "fp8", "1-ulp")}
                      for dtype, rows in by_dtype.items()}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------------- main
def bench(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) * MIB for s in args.sizes_mib.split(",")]
    figures: dict[str, Any] = {"sizes_mib": [s // MIB for s in sizes]}
    if args.transport == "cuda_ipc":
        gbps = cuda_ipc_figures(sizes, args.device)
        ipc, d2d = gbps["cuda_ipc (2 processes)"], gbps["d2d copy (1 process)"]
        return {"device": args.device, **figures, "gbps": {k: _by_mib(row) for k, row in gbps.items()},
                "cuda_ipc_vs_d2d": {str(s // MIB): ipc[s] / d2d[s] for s in sizes}}
    parts = set(args.parts.split(","))
    if "transport" in parts:
        log("memcpy and shared-memory limits")
        gbps = {"memcpy (1 process)": memcpy(sizes), "shm round trip": two_process("shm", sizes)}
        if nixl_available():
            log("nixl")
            gbps["nixl"] = two_process("nixl", sizes)
        if not args.no_ray:
            log("ray object store (starting a local cluster)")
            gbps["object_store"] = object_store(sizes)
        gbps["local (1 process)"] = local(sizes)
        figures["gbps"] = {k: _by_mib(row) for k, row in gbps.items()}
        if "nixl" in gbps:
            figures["nixl_vs_shm"] = {str(s // MIB): gbps["nixl"][s] / gbps["shm round trip"][s] for s in sizes}
    if "codec" in parts:
        log("codecs")  # the lossless one on real KV: --parts lossless
        figures["codec"] = codec_figures(args.codec_blocks)
    if "lossless" in parts:
        from bench.transfer_lossless import lossless_figures

        figures["lossless"] = lossless_figures(args.dtypes.split(","), [int(n) for n in args.lossless_tokens.split(",")])
    if "quality" in parts and args.prompts > 0:
        figures["quality"] = {}
        figures["quality_prompt_tokens"] = args.prompt_tokens or "short"
        figures["quality_prompts"], figures["quality_tokens"] = args.prompts, args.tokens
        for dtype in args.dtypes.split(","):
            log(f"quality on SmolLM2 in {dtype}")
            figures["quality"][dtype] = quality(args.prompts, args.tokens, dtype, args.prompt_tokens)
        if args.write_quality:
            write_quality(args.write_quality, figures["quality"], args)
    return figures


def _by_mib(row: dict[int, float]) -> dict[str, float]:
    return {str(size // MIB): v for size, v in row.items()}


def render(figures: dict[str, Any]) -> str:
    out = []
    head = [f"{s} MiB" for s in figures["sizes_mib"]]
    if "cuda_ipc_vs_d2d" in figures:
        rows = [[k, *row.values()] for k, row in figures["gbps"].items()]
        rows.append(["cuda_ipc / d2d", *figures["cuda_ipc_vs_d2d"].values()])
        return format_table(["path", *head], rows, f"Same-node transfer on {figures['device']}, GB/s (median)")
    if "gbps" in figures:
        rows = [[k, *row.values()] for k, row in figures["gbps"].items()]
        if "nixl_vs_shm" in figures:
            rows.append(["nixl / shm", *figures["nixl_vs_shm"].values()])
        out.append(format_table(["path", *head], rows, "Transport round trip, GB/s (median)"))
    if "codec" in figures:
        keys = ["codec", "raw_mib", "wire_mib", "ratio_vs_bf16", "encode_gbps", "decode_gbps"]
        codec_rows = [[r[k] for k in keys] for r in figures["codec"]]
        out.append(format_table(keys, codec_rows, "Codec on SmolLM2-shaped bf16 KV, 4 shards"))
    if "lossless" in figures:
        from bench.transfer_lossless import render as render_lossless

        out.append(render_lossless(figures["lossless"]))
    if "quality" in figures:
        keys = ["forced_agreement", "forced_agreement_ties", "free_agreement", "prompts_identical", "max_logit_diff",
                "mean_kl"]
        heads = ["forced", "forced (ties)", "free", "identical", "max_logit_diff", "mean_kl"]
        n, tokens, length = figures["quality_prompts"], figures["quality_tokens"], figures["quality_prompt_tokens"]
        for dtype, q_rows in figures["quality"].items():
            fmt = {"prompts_identical": f"{{}}/{n}", "mean_kl": "{:.2e}", "max_logit_diff": "{:.3f}"}
            rows = [[r["variant"], *(fmt.get(k, "{:.4f}").format(r[k]) for k in keys)] for r in q_rows]
            title = (f"Token agreement with uncompressed KV: SmolLM2 ({dtype}), {n} "
                     f"{'' if length == 'short' else f'{length}-token '}prompts x {tokens} greedy tokens\n"
                     "(forced: fed the reference's tokens, per step; (ties): a pick the other side's logits tie with"
                     " its own counts as agreement;\n free: its own tokens; max_logit_diff and mean_kl (nats): forced"
                     " steps; 1-ulp: every KV value one step off, the floor)")
            out.append(format_table(["variant", *heads], rows, title))
    return "\n\n".join(out)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--sizes-mib", default="1,16,256")
    ap.add_argument("--parts", default="transport,codec,quality",
                    help="which tables to produce (lossless: the zstd codec on SmolLM2's real KV)")
    ap.add_argument("--lossless-tokens", default="1024,2048,4096", help="lossless: prompt lengths, tokens")
    ap.add_argument("--write-quality", metavar="FILE",
                    help="quality: also write the lossy codecs' figures there (deploy/kv_codec_quality.json is "
                         "what `ferry status` and the README show)")
    ap.add_argument("--no-ray", action="store_true", help="skip the object-store row (no Ray start)")
    ap.add_argument("--codec-blocks", type=int, default=128, help="KV blocks in the codec figures")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="quality: prompts of this many tokens of real text (the repo's docs); 0: short PROMPTS")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes for the quality figures, a table each")
    ap.add_argument("--transport", choices=["all", "cuda_ipc"], default="all",
                    help="cuda_ipc: only the same-node table, cuda_ipc between two processes vs one d2d copy"
                         " (needs torch, CUDA and cupy; neither Ray nor NIXL)")
    ap.add_argument("--device", default="cuda:0", help="--transport cuda_ipc: the GPU (cpu: shared host memory)")
    run(bench, ap.parse_args(), render)


if __name__ == "__main__":
    main()
