"""The machine's prefill bound: the highest request rate any system could sustain here.

Mental model: every request's prompt must be prefilled once, and on a CPU box prefill is compute
bound, so (the engine's own prefill tokens/s with every core) / (the workload's mean prompt tokens)
is a ceiling on requests/s that no scheduling can beat; a system's knee as a fraction of it says
how much of the machine that system turns into goodput. It is measured in the harness process,
before any server starts, with ferry's engine in the dtype its peers serve, on prompts of the
workload's mean length chunked the way a served engine chunks them (512 tokens per step).

The prefill bound ignores decoding, which shares the same cores. The compute bound counts it: with
the engine's decode tokens/s at the servers' full batch (`decode_rows` rows of the workload's
mean prompt length, decode-only steps, every core), one request costs mean prompt / prefill tokens/s
plus mean output / decode tokens/s seconds of the whole machine, and 1 / that is the highest rate
the machine could serve if nothing else cost anything: a full batch is decoding's cheapest
per-token price, so this too is a ceiling, only a nearer one.
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
    decode_tok_s: float | None = None  # decode-only steps at `decode_rows` rows; None: not measured
    decode_rows: int = 0
    mean_output_tokens: float = 0.0

    @property
    def rps(self) -> float:
        return self.prefill_tok_s / self.mean_prompt_tokens

    @property
    def compute_rps(self) -> float | None:
        """The rate at which prefill plus decode take every core (see the module notes)."""
        if not self.decode_tok_s:
            return None
        return 1.0 / (self.mean_prompt_tokens / self.prefill_tok_s + self.mean_output_tokens / self.decode_tok_s)

    def to_dict(self) -> dict[str, float | int | str | None]:
        return {**asdict(self), "rps": self.rps, "compute_rps": self.compute_rps}

    def describe(self) -> str:
        text = (f"prefill bound: {self.rps:.3f} rps = {self.prefill_tok_s:.0f} prefill tokens/s (ferry engine, "
                f"{self.dtype}, {self.threads} threads, {self.prompt_tokens}-token prompts) / "
                f"{self.mean_prompt_tokens:.0f} mean prompt tokens")
        if self.compute_rps is not None:
            text += (f"; compute bound (prefill + decode): {self.compute_rps:.3f} rps = 1 / ("
                     f"{self.mean_prompt_tokens:.0f} / {self.prefill_tok_s:.0f} + {self.mean_output_tokens:.0f} / "
                     f"{self.decode_tok_s:.0f} decode tokens/s at {self.decode_rows} rows)")
        return text


def measure_prefill_bound(model: str | Path, dtype: str, mean_prompt_tokens: float, runs: int = 3,
                          seed: int = 0, mean_output_tokens: float = 0.0, decode_rows: int = 0,
                          decode_steps: int = 16) -> PrefillBound:
    import torch

    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.sampling import SamplingParams

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    n = max(1, round(mean_prompt_tokens))
    rows = max(1, decode_rows)
    # Tokens a decode row may emit (`_decode_tok_s`): a prefill step per chunk of every prompt
    # before the window, a warm-up step, the window, and a margin.
    room = rows * -(-n // CHUNK_TOKENS) + decode_steps + 4
    engine = Engine.from_pretrained(model, EngineConfig(device="cpu", dtype=dtype, max_num_seqs=max(4, rows),
                                                        max_num_batched_tokens=CHUNK_TOKENS,
                                                        max_model_len=n + room,
                                                        kv_cache_bytes=rows * (n + room + 64) * 64 << 10,
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
    decode_tok_s = None
    if decode_rows and mean_output_tokens > 0:
        decode_tok_s = _decode_tok_s(engine, [[rng.randrange(100, vocab) for _ in range(n)] for _ in range(rows)],
                                     decode_steps, room)
    return PrefillBound(statistics.median(rates), n, mean_prompt_tokens, engine.cfg.dtype, threads,
                        decode_tok_s, decode_rows if decode_tok_s else 0, mean_output_tokens)


def _decode_tok_s(engine, prompts: list[list[int]], steps: int, max_tokens: int) -> float:  # noqa: ANN001 (an Engine)
    """Tokens/s of `steps` decode-only steps with every prompt's row decoding. The prompts are
    prefilled one after another, so the first to start decodes while the last still prefills:
    `max_tokens` must cover the prefill steps before the window, one warm-up step and the window,
    so every row still runs while the window is timed; then they are aborted."""
    from actors.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"bound-decode-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    while len(started) < len(prompts) and engine.has_unfinished_requests():
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    engine.step()  # warm-up: the first step at the full batch's shapes
    t0, tokens = time.perf_counter(), 0
    for _ in range(steps):
        outputs = engine.step()
        if sum(1 for o in outputs if o.new_token_ids) != len(prompts):
            raise RuntimeError("a decode row stopped inside the timed window: max_tokens too small")
        tokens += sum(len(o.new_token_ids) for o in outputs)
    elapsed = time.perf_counter() - t0
    for rid in ids:
        engine.abort(rid)
    return tokens / elapsed if elapsed > 0 else 0.0


def _render(figures: dict) -> str:  # type: ignore[type-arg]
    from bench.common import format_table

    rows = [(r["decode_rows"], r["decode_tok_s"], r["decode_step_ms"], r["prefill_tok_s"], r["rps"],
             r["compute_rps"], r["compute_rps"] / r["rps"]) for r in figures["runs"]]
    return format_table(("decode rows", "decode tok/s", "step ms", "prefill tok/s", "prefill bound rps",
                         "compute bound rps", "compute / prefill"), rows,
                        title=(f"{figures['model']}, {figures['dtype']}, {figures['prompt_tokens']}-token prompts, "
                               f"{figures['output_tokens']} output tokens"))


def main() -> None:
    """The bounds at several decode batch sizes: how near the prefill bound prefill plus decode
    can come on this machine, decoding at its cheapest per-token price (the batch a TPOT target
    still allows; the step time is printed beside it)."""
    import argparse

    from actors.engine.fetch import resolve_model
    from bench.common import progress, report

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=float, default=414.0, help="the workload's mean prompt length")
    parser.add_argument("--output-tokens", type=float, default=100.0, help="the workload's mean output length")
    parser.add_argument("--rows", default="8,16,32", help="decode batch sizes, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = resolve_model(args.model)
    runs = []
    for rows in (int(r) for r in args.rows.split(",")):
        progress(f"{rows} decode rows of {args.prompt_tokens:.0f}-token prompts")
        b = measure_prefill_bound(model, args.dtype, args.prompt_tokens, runs=args.runs,
                                  mean_output_tokens=args.output_tokens, decode_rows=rows)
        assert b.decode_tok_s is not None
        runs.append({**b.to_dict(), "decode_step_ms": 1e3 * rows / b.decode_tok_s})
    report({"model": args.model, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens, "runs": runs}, args.json, _render)


if __name__ == "__main__":
    main()
