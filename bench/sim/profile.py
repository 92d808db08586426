"""Measure a step-time profile from this project's own engine, for `python -m bench.sim --profile`.

Mental model: the simulator's physics is a function (prefill tokens, prefill attention pairs,
decode rows, context tokens) -> step seconds. Here the real `actors.engine.Engine` runs steps of
known composition and the wall time of each (`Engine._last_step_s`, the forward + sampling) is
recorded: prefill-only steps of one prompt of N tokens, and pure decode steps of B rows with C
tokens of context each. The JSON written is what `hardware.ProfileCost` fits. On this project's
CPU machines with SmolLM2-135M the figures describe a CPU worker, orders of magnitude slower than
the H200 default; `--profile-scale` maps them onto a faster device if wanted.

    python -m bench.sim.profile --out /tmp/smollm2_cpu_profile.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from bench.common import bench_parser, progress, run


def measure(model: str = "smollm2", prefill_lengths: tuple[int, ...] = (32, 128, 256, 512, 1024),
            decode_shapes: tuple[tuple[int, int], ...] = ((1, 64), (4, 64), (16, 64), (4, 512), (16, 256), (32, 128)),
            repeats: int = 3) -> dict[str, Any]:
    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.options import RequestOptions
    from actors.engine.sampling import SamplingParams

    cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_bytes=1 << 30,
                       enable_prefix_caching=False)
    engine = Engine.from_pretrained(model, cfg)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    entries: list[dict[str, float]] = []
    counter = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    for n in prefill_lengths:
        times = []
        for _ in range(repeats):
            rid = f"pf{next(counter)}"
            engine.add_request(rid, prompt(n), SamplingParams(max_tokens=1), RequestOptions(prefill_only=True))
            engine.step()
            times.append(engine._last_step_s)
            engine.release_kv(rid)
        entries.append({"prefill_tokens": n, "prefill_pairs": n * n / 2.0, "decode_rows": 0,
                        "context_tokens": 0, "step_s": statistics.median(times)})
        progress(f"profile: prefill {n} tokens: {entries[-1]['step_s'] * 1e3:.1f} ms")
    for rows, ctx in decode_shapes:
        params = SamplingParams(max_tokens=repeats + 2, ignore_eos=True, temperature=0.0)
        ids = [f"dc{next(counter)}" for _ in range(rows)]
        for rid in ids:
            engine.add_request(rid, prompt(ctx), params)
        while any(engine.requests[r].num_computed_tokens < engine.requests[r].num_prompt_tokens for r in ids):
            engine.step()  # prefills (and their first tokens) first
        times = []
        for _ in range(repeats):
            engine.step()
            times.append(engine._last_step_s)
        while engine.has_unfinished_requests():
            engine.step()
        entries.append({"prefill_tokens": 0, "prefill_pairs": 0.0, "decode_rows": rows,
                        "context_tokens": rows * (ctx + 2), "step_s": statistics.median(times)})
        progress(f"profile: decode {rows} rows x {ctx} ctx: {entries[-1]['step_s'] * 1e3:.1f} ms")
    return {"model": model, "device": "cpu", "engine": "actors.engine.Engine", "entries": entries}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    profile = measure(args.model)
    Path(args.out).write_text(json.dumps(profile, indent=2))
    return profile


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, model="smollm2")
    ap.add_argument("--out", required=True)
    run(bench, ap.parse_args(argv), lambda profile: json.dumps(profile, indent=2))  # the profile is its table
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
