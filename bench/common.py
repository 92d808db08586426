"""The harness every bench shares: its command line, its run, and how it prints its figures.

Mental model: a bench is `bench(args) -> figures` (plain or async) and `render(figures) -> str`.
`bench_parser` gives its command line `--json` and whichever shared flags it names (the same names
and meanings everywhere); `run` times it (optionally on a fresh local Ray cluster), adds `wall_s`,
and prints the readable table or, with `--json`, the very same figures as JSON, so a script can
diff runs. Progress goes to stderr so that stdout stays parseable either way.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from transfer.units import MIB

Figures = dict[str, Any]

# The flags several benches share, each with one meaning; a bench names the ones it takes, with its default.
SHARED_FLAGS: dict[str, dict[str, Any]] = {
    "model": {"help": "a model name (smollm2), GGUF file or HF folder"},
    "dtype": {"help": "engine dtype; auto: bfloat16 on CUDA and bf16-capable CPUs, else float32"},
    "device": {"help": "auto (cuda when torch sees one), cpu, cuda or cuda:N"},
    "threads": {"type": int, "help": "torch threads"},
}


def bench_parser(doc: str | None, **shared: Any) -> argparse.ArgumentParser:
    """A bench's command line: its docstring as the help, `--json`, and each flag of SHARED_FLAGS
    named in `shared` (`model="smollm2"`, `threads=2`), with that default."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    for name, default in shared.items():
        p.add_argument(f"--{name}", default=default, **SHARED_FLAGS[name])
    return p


def csv(kind: type) -> Callable[[str], list[Any]]:
    """An argparse type: a comma-separated list of `kind`."""
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def run(bench: Callable[[Any], Figures | Awaitable[Figures]], args: argparse.Namespace,
        render: Callable[[Figures], str], local_ray: bool = False) -> Figures:
    """Runs `bench(args)` (a coroutine function too) under `args.threads` torch threads where the
    bench has that flag, on a fresh local Ray cluster (2 CPUs, loopback, no dashboard) with
    `local_ray`; adds the wall time as `wall_s`, prints the figures (`report`) and returns them."""
    t0 = time.perf_counter()
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if local_ray:
        import ray

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        figures = bench(args)
        if inspect.isawaitable(figures):
            figures = asyncio.run(figures)  # type: ignore[arg-type]
    finally:
        if local_ray:
            ray.shutdown()
    figures["wall_s"] = time.perf_counter() - t0
    report(figures, args.json, render)
    return figures


def run_on_local_ray(bench: Callable[[Any], Awaitable[Figures]], args: Any, render: Callable[[Figures], str]) -> None:
    run(bench, args, render, local_ray=True)


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def best_s(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, Any]:
    """(the fastest of `repeats` calls, in seconds; the last call's result)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


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


def report(figures: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], str]) -> None:
    """A benchmark's figures: as JSON (`--json`), or as its readable table."""
    print(json.dumps(figures, indent=2, default=str) if as_json else render(figures))


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
    return size_bytes / best_s(lambda: dst.copy_(src), repeats)[0]


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, timeout_s: float) -> None:
    """Until the app at `url` answers `/health` with `healthy` true; TimeoutError past `timeout_s`."""
    import httpx2

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx2.get(f"{url}/health", timeout=10, trust_env=False)
            if r.status_code == 200 and r.json().get("healthy"):
                return
        except (httpx2.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not say healthy within {timeout_s:g} s")


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Ray prints its processes' messages ("(raylet) ...") on the driver's stdout: while a bench runs
    an app, they go to stderr, so that stdout holds the figures alone (`--json` stays parseable)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
