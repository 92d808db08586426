"""How two CPU engines on one node should share its cores: split, shared, or shared with spinning threads.

A disaggregated app on a CPU node runs a prefill engine and a decode engine in two processes. This
bench runs the same pair the way the app can: a prefill process repeatedly prefilling one
`--prompt-tokens` prompt, beside a decode process stepping `--rows` rows, each configuration for
`--seconds`, and each engine alone too (the other one started, waiting idle, as in the app):
- split: each engine has cores/2 threads (the app's former default);
- shared: each has every core, with OpenMP's passive wait policy (`engine.cpu_cores: shared`, the
  default): idle threads sleep, so a lone busy engine gets all the cores;
- spinning: each has every core with libgomp's default wait policy (torch's own default);
- lent: shared, and the engines lend each other the cores by SLO slack (`engine.lend_cores`):
  the prefill claims the cores while it computes, and the decode, whose rows have a
  `--tpot-ms` target, waits between steps while each row is ahead of it (actors/core_share.py).
  Its "ms/step" then counts those waits: it is the time per output token a row sees.
The figures are prefill tokens/s and decode milliseconds per step, measured in the same run; the
ratios compare each configuration with split.

    python -m bench.cores [--seconds 20] [--configs split,shared,spinning,lent] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

from actors.core_share import CORE_SHARE_ENV, CoreShare, DecodeYield, PrefillClaim, engine_rows
from actors.worker_config import SHARED_CORES_ENV
from bench.common import bench_parser, csv, format_table, progress, run

# (threads: half or all of the CPUs, the environment the app gives its workers)
CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "split": ("half", {}),
    "shared": ("all", SHARED_CORES_ENV),  # what `engine.cpu_cores: shared` sets in each worker
    "spinning": ("all", {}),
    "lent": ("all", {**SHARED_CORES_ENV, CORE_SHARE_ENV: ""}),  # the claim file: one per bench run
}


def _worker(role: str, threads: int, seconds: float, prompt_tokens: int, rows: int, model: str,
            tpot_ms: float, dtype: str) -> None:
    """Runs in its own process (the wait policy is read when libgomp loads): loads and warms one
    engine, prints "ready", then measures once per "run" line on stdin (printing the figure as a
    JSON line) until stdin closes. Between runs it waits on stdin, its threads idle."""
    import torch

    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.options import RequestOptions
    from actors.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    share = CoreShare.from_env()  # "lent" only
    engine = Engine.from_pretrained(model, EngineConfig(dtype=dtype, device="cpu", max_num_seqs=max(rows, 1),
                                                        max_num_batched_tokens=max(prompt_tokens, 64),
                                                        kv_cache_bytes=512 << 20))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    ids = iter(range(1 << 30))

    def add(n: int, max_tokens: int) -> None:
        engine.add_request(f"r{next(ids)}", [rng.randrange(vocab) for _ in range(n)],
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           RequestOptions(tpot_target_s=tpot_ms * 1e-3))

    claim = PrefillClaim(share) if share is not None and role == "prefill" else None
    lender = DecodeYield(share) if share is not None and role == "decode" else None

    def step() -> None:
        if claim is not None:
            claim.before_step(None)
        elif lender is not None:
            while (wait := lender.pause_s(engine_rows(engine))) > 0:
                time.sleep(wait)
        engine.step()
        if claim is not None:
            claim.after_step(engine, None)

    def prefill() -> dict[str, float]:
        start, tokens = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            add(prompt_tokens, 1)
            while engine.has_unfinished_requests():
                step()
            tokens += prompt_tokens
        return {"prefill_tok_s": tokens / (time.perf_counter() - start)}

    def decode() -> dict[str, float]:
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or steps == 0:
            step()
            steps += 1
        return {"decode_step_ms": 1e3 * (time.perf_counter() - start) / steps}

    add(32, 2)  # warm-up: first-call costs out of the figures
    while engine.has_unfinished_requests():
        engine.step()
    if role == "decode":
        for _ in range(rows):
            add(32, engine.max_model_len - 32)  # rows that outlast every run
        for _ in range(3):  # every row past its prompt: decode-only steps from here
            engine.step()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            print(json.dumps(prefill() if role == "prefill" else decode()), flush=True)


class _Engine:
    """One worker process of a configuration, ready to measure on `start()`."""

    def __init__(self, role: str, config: str, args: argparse.Namespace, cpus: int) -> None:
        threads_kind, extra_env = CONFIGS[config]
        threads = max(1, cpus // 2) if threads_kind == "half" else cpus
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
        env.update(extra_env)
        if CORE_SHARE_ENV in extra_env:
            env[CORE_SHARE_ENV] = args.core_share
        argv = [sys.executable, "-m", "bench.cores", "--worker", role, "--threads", str(threads),
                "--seconds", str(args.seconds), "--prompt-tokens", str(args.prompt_tokens), "--rows", str(args.rows),
                "--model", args.model, "--tpot-ms", str(args.tpot_ms), "--dtype", args.dtype]
        self.role = role
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.role} worker exited with {self.proc.wait()}")
        return line.strip()

    def ready(self) -> None:
        while self._line() != "ready":
            pass

    def start(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, float]:
        return json.loads(self._line())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.wait(60) != 0:
            raise RuntimeError(f"the {self.role} worker exited with {self.proc.returncode}")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Per configuration, both engines start (in parallel) and measure alone, one after the other
    while the other waits idle, then together."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    figures: dict[str, Any] = {"cpus": cpus, "dtype": args.dtype, "tpot_ms": args.tpot_ms,
                               "prompt_tokens": args.prompt_tokens, "rows": args.rows,
                               "seconds": args.seconds, "configs": {}}
    args.core_share = os.path.join(tempfile.mkdtemp(prefix="ferry-cores-"), "claim")
    for config in [c for c in CONFIGS if c == "split" or c in args.configs]:  # split: the ratios' baseline
        progress(f"{config}: starting both engines")
        engines = [_Engine(role, config, args, cpus) for role in ("prefill", "decode")]
        row: dict[str, float] = {}
        try:
            for engine in engines:
                engine.ready()
            for engine in engines:
                progress(f"{config}: {engine.role} alone")
                engine.start()
                row.update({f"alone_{k}": v for k, v in engine.result().items()})
            progress(f"{config}: prefill beside decode")
            for engine in engines[::-1]:  # decode first: the prefill starts against running rows
                engine.start()
            for engine in engines:
                row.update({f"together_{k}": v for k, v in engine.result().items()})
        finally:
            for engine in engines:
                engine.close()
        figures["configs"][config] = row
    split = figures["configs"]["split"]
    for row in figures["configs"].values():
        row["together_prefill_vs_split"] = row["together_prefill_tok_s"] / split["together_prefill_tok_s"]
        row["alone_prefill_vs_split"] = row["alone_prefill_tok_s"] / split["alone_prefill_tok_s"]
    return figures


def render(figures: dict[str, Any]) -> str:
    rows = [[name, round(r["alone_prefill_tok_s"]), round(r["alone_decode_step_ms"], 1),
             round(r["together_prefill_tok_s"]), round(r["together_decode_step_ms"], 1),
             round(r["alone_prefill_vs_split"], 2), round(r["together_prefill_vs_split"], 2)]
            for name, r in figures["configs"].items()]
    title = (f"{figures['cpus']} CPUs, SmolLM2 {figures['dtype']}: a {figures['prompt_tokens']}-token prefill process and a "
             f"{figures['rows']}-row decode process, {figures['seconds']:g} s each")
    return format_table(["cores", "prefill tok/s alone", "decode ms/step alone", "prefill tok/s together",
                         "decode ms/step together", "prefill alone vs split", "prefill together vs split"],
                        rows, title)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, model="smollm2", dtype="auto")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tpot-ms", type=float, default=200.0, help="the decode rows' TPOT target (lent)")
    p.add_argument("--configs", type=csv(str), default=list(CONFIGS),
                   help=f"which of {','.join(CONFIGS)} to run (split always runs: the baseline)")
    p.add_argument("--worker", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if unknown := set(args.configs) - set(CONFIGS):
        p.error(f"unknown --configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    if args.worker:
        _worker(args.worker, args.threads, args.seconds, args.prompt_tokens, args.rows, args.model,
                args.tpot_ms, args.dtype)
        return 0
    args.threads = None  # the workers set their own
    run(measure, args, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
