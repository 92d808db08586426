"""Synthetic arrival processes: Poisson and gamma with a burstiness factor, as `vllm bench serve`.

Mental model: inter-arrival gaps are i.i.d. Gamma(shape=burstiness, scale=1/(rate*burstiness)), so
the mean gap is 1/rate for any burstiness; burstiness 1 is exactly Poisson (exponential gaps),
below 1 clumps requests into bursts, above 1 spaces them more evenly. Seeded, so runs repeat.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from bench.loadgen.workload import BenchRequest


def arrival_times(num: int, rate_rps: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """`num` arrival times starting at 0 (the first request is sent at once)."""
    assert rate_rps > 0 and burstiness > 0 and num >= 0
    if num == 0:
        return []
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate_rps * burstiness), size=num - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def synthetic_workload(num: int, rate_rps: float, burstiness: float, seed: int,
                       lengths: list[BenchRequest] | None = None, input_len: int = 128,
                       output_len: int = 32) -> list[BenchRequest]:
    """Arrivals from the process; lengths (and hash ids) sampled from `lengths` if given, else fixed."""
    times = arrival_times(num, rate_rps, burstiness, seed)
    if not lengths:
        return [BenchRequest(arrival_s=t, prompt_len=input_len, output_len=output_len) for t in times]
    rng = np.random.default_rng(seed + 1)
    picks = rng.integers(0, len(lengths), size=num)
    return [replace(lengths[int(i)], arrival_s=t) for t, i in zip(times, picks)]
