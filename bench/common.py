"""Small helpers every bench shares: progress lines, tables, JSON output, memory bandwidth, peak RSS.

Benches print a human table by default and the very same figures as JSON with `--json`, so a
script can diff runs. Progress goes to stderr so that stdout stays parseable either way.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

MIB = 1 << 20


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of one call."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def gb_per_s(size: int, once: Callable[[], None]) -> float:
    """Median GB/s of `once` moving `size` bytes, after one untimed warm-up (more repeats when small)."""
    once()
    times = []
    for _ in range(20 if size <= MIB else 8 if size <= 16 * MIB else 3):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times) / 1e9


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain left/right-aligned text table: strings left, numbers right."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for j, c in enumerate(row):
            widths[j] = max(widths[j], len(c))
    numeric = [all(_is_number(row[j]) for row in rows if row[j] is not None) for j in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out.append(line(list(headers)))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0 or abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}"
    return str(v)


def print_json(figures: dict[str, Any]) -> None:
    print(json.dumps(figures, indent=2, sort_keys=False))


def report(figures: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], str]) -> None:
    """A benchmark's figures: as JSON (`--json`), or as its readable table."""
    print_json(figures) if as_json else print(render(figures))


def memcpy_bandwidth_bytes_per_s(size_bytes: int = 512 * MIB, repeats: int = 5) -> float:
    """Best-of-`repeats` rate of a large torch copy, as bytes copied per second.

    The copy reads and writes `size_bytes` each, so memory traffic is at least twice this rate;
    this is the figure `memcpy` benchmarks (and the notes) quote. It runs in a child interpreter
    with this process's torch thread count, so its 2 x `size_bytes` of buffers never show up in
    the caller's peak RSS.
    """
    code = (
        "import sys, torch; from bench.common import measure_copy_rate; "
        f"torch.set_num_threads({torch.get_num_threads()}); "
        f"print(measure_copy_rate({int(size_bytes)}, {int(repeats)}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=600)
    return float(done.stdout.strip().splitlines()[-1])


def measure_copy_rate(size_bytes: int, repeats: int) -> float:
    """In-process body of `memcpy_bandwidth_bytes_per_s` (bytes copied per second, best run)."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32)  # written, so its pages are resident
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the destination's pages in before timing
    best_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best_s = min(best_s, time.perf_counter() - t0)
    return size_bytes / best_s


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def run_on_local_ray(bench: Callable[[Any], Awaitable[dict[str, Any]]], args: Any,
                     render: Callable[[dict[str, Any]], str]) -> None:
    """Runs `bench(args)` on a fresh local Ray cluster (2 CPUs, loopback, no dashboard), adds the
    wall time as `wall_s`, and prints the figures as a table (`render`) or, with `args.json`, JSON."""
    import asyncio

    import ray

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        figures = asyncio.run(bench(args))
    finally:
        ray.shutdown()
    figures["wall_s"] = time.perf_counter() - t0
    report(figures, args.json, render)
