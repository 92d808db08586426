"""`bench/transfer.py --transport cuda_ipc`: same-node KV transfer between two processes.

Mental model: a receiver process (spawned: no Ray, no NIXL, so it runs on the GPU check machine)
owns a cuda_ipc arena on the device; the sender maps it and `send`s bytes already on its GPU; the
clock runs until the receiver holds the Delivery and says so. The baseline is one device-to-device
copy of the same bytes in one process; both are bytes moved per second, and `cuda_ipc_vs_d2d` is
their ratio per size. With device "cpu" both rows are host memory (the shared-memory arena, a memcpy).
"""

from __future__ import annotations

import json
import multiprocessing as mp
from typing import Any

import torch

from bench.common import MIB, format_table, gb_per_s

def _ipc_receiver(device: str, max_size: int, conn: Any) -> None:
    """Child process: a cuda_ipc endpoint whose arena is on `device`; takes each shard and acks."""
    from transfer.cuda_ipc import CudaIpcConfig, CudaIpcTransport

    t = CudaIpcTransport("bench-ipc-rx", CudaIpcConfig(recv_staging_bytes=max_size + MIB, device=device))
    conn.send_bytes(t.metadata())
    while conn.recv_bytes() == b"go":
        with t.recv(60.0) as d:
            assert len(d.data) > 0
        conn.send_bytes(b"k")
    t.close()


def cuda_ipc_figures(sizes: list[int], device: str) -> dict[str, dict[int, float]]:
    """cuda_ipc between two processes (spawned, no Ray, no NIXL) against one device-to-device copy
    of the same bytes in one process. The clock runs from the sender's `send` of bytes already on
    its GPU until the receiver holds the Delivery (bytes in its arena on its GPU) and says so.
    With device "cpu" both rows are host memory (the shared-memory arena, and a memcpy)."""
    from transfer.cuda_ipc import CudaIpcConfig, CudaIpcTransport

    src = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    src = src.to(device)
    dst = torch.ones_like(src)

    def sync() -> None:
        if src.is_cuda:
            torch.cuda.synchronize(src.device)

    def copy(size: int) -> None:
        dst[:size].copy_(src[:size])
        sync()

    out = {"d2d copy (1 process)": {size: gb_per_s(size, lambda size=size: copy(size)) for size in sizes}}
    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    proc = ctx.Process(target=_ipc_receiver, args=(device, max(sizes), child_end), daemon=True)
    proc.start()
    tx = CudaIpcTransport("bench-ipc-tx", CudaIpcConfig(recv_staging_bytes=MIB, device=device))
    try:
        if not conn.poll(120):
            raise RuntimeError("the cuda_ipc receiver did not start within 120 s")
        tx.add_peer(conn.recv_bytes())

        def once(size: int) -> None:
            conn.send_bytes(b"go")
            tx.send("bench-ipc-rx", [src[:size]], timeout_s=60.0)
            assert conn.poll(60) and conn.recv_bytes() == b"k"

        out["cuda_ipc (2 processes)"] = {size: gb_per_s(size, lambda size=size: once(size)) for size in sizes}
        conn.send_bytes(b"stop")
    finally:
        tx.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


def print_cuda_ipc(sizes: list[int], device: str, as_json: bool) -> None:
    gbps = cuda_ipc_figures(sizes, device)
    ipc, d2d = gbps["cuda_ipc (2 processes)"], gbps["d2d copy (1 process)"]
    figures = {"device": device, "sizes_mib": [s // MIB for s in sizes],
               "gbps": {k: {str(s // MIB): v for s, v in row.items()} for k, row in gbps.items()},
               "cuda_ipc_vs_d2d": {str(s // MIB): ipc[s] / d2d[s] for s in sizes}}
    if as_json:
        print(json.dumps(figures, indent=2))
        return
    rows = [[k, *row.values()] for k, row in figures["gbps"].items()]
    rows.append(["cuda_ipc / d2d", *figures["cuda_ipc_vs_d2d"].values()])
    print(format_table(["path", *[f"{s} MiB" for s in figures["sizes_mib"]]], rows,
                       f"Same-node transfer on {device}, GB/s (median)"))
