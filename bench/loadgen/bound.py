"""The machine's prefill bound: the highest request rate any system could sustain here.

Mental model: every request's prompt must be prefilled once, and on a CPU box prefill is compute
bound, so (the engine's own prefill tokens/s with every core) / (the workload's mean prompt tokens)
is a ceiling on requests/s that no scheduling can beat; a system's knee as a fraction of it says
how much of the machine that system turns into goodput. It is measured in the harness process,
before any server starts, with ferry's engine in the dtype its peers serve, on prompts of the
workload's mean length chunked the way a served engine chunks them (512 tokens per step).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

CHUNK_TOKENS = 512  # the served engines' max_num_batched_tokens (deploy/serve.yaml)


@dataclass(frozen=True)
class PrefillBound:
    prefill_tok_s: float  # median over runs, all cores
    prompt_tokens: int  # the measured prompts' length (the workload's mean, rounded)
    mean_prompt_tokens: float
    dtype: str
    threads: int

    @property
    def rps(self) -> float:
        return self.prefill_tok_s / self.mean_prompt_tokens

    def to_dict(self) -> dict[str, float | int | str]:
        return {**asdict(self), "rps": self.rps}

    def describe(self) -> str:
        return (f"prefill bound: {self.rps:.3f} rps = {self.prefill_tok_s:.0f} prefill tokens/s (ferry engine, "
                f"{self.dtype}, {self.threads} threads, {self.prompt_tokens}-token prompts) / "
                f"{self.mean_prompt_tokens:.0f} mean prompt tokens")


def measure_prefill_bound(model: str | Path, dtype: str, mean_prompt_tokens: float, runs: int = 3,
                          seed: int = 0) -> PrefillBound:
    import torch

    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.sampling import SamplingParams

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    n = max(1, round(mean_prompt_tokens))
    engine = Engine.from_pretrained(model, EngineConfig(device="cpu", dtype=dtype, max_num_seqs=4,
                                                        max_num_batched_tokens=CHUNK_TOKENS,
                                                        max_model_len=n + 8, kv_cache_bytes=(n + 64) * 64 << 10,
                                                        enable_prefix_caching=False))
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rates = []
    for i in range(runs + 1):  # the first run warms the kernels up and is not counted
        prompt = [rng.randrange(100, vocab) for _ in range(n)]
        t0 = time.perf_counter()
        engine.generate([prompt], params)
        if i:
            rates.append(n / (time.perf_counter() - t0))
    return PrefillBound(statistics.median(rates), n, mean_prompt_tokens, engine.cfg.dtype, threads)
