"""vLLM's CPU engine on the prompts bench/engine.py gives ferry's engine: run by vLLM's own venv.

Run with the interpreter bench/build_peers.sh vllm installs (it imports vllm, never ferry):

    ~/.cache/ferry/peers/vllm-venv/bin/python bench/vllm_probe.py --model DIR [--dtype float32]
        [--prefill-tokens 512,1024] [--batch-sizes 1,16] [--gen-tokens 32] [--threads 2]

DIR is the Hugging Face folder `ferry models export smollm2 DIR` writes, so both engines load the
same weights. Prints one JSON object on stdout (progress on stderr). Measured as bench/engine.py
measures its transformers baseline: prefill tok/s = prompt tokens / time of generate(max_tokens=1)
on a fresh random prompt (median of `--runs`, prefix caching off so nothing is reused); decode tok/s
at B = (gen - 1) x B / (time(generate gen tokens) - time(generate 1 token)) on B random prompts of
64 tokens, greedy, ignore_eos.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

# Run as a script, Python puts bench/ first on the path, where bench/kernels.py would shadow the
# `kernels` package vLLM imports.
_here = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefill-tokens", default="512,1024")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--decode-prompt-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # its engine-core queues on loopback only
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")  # OpenMP threads on cores 0..N-1
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prefills = [int(x) for x in args.prefill_tokens.split(",") if x]
    batches = [int(x) for x in args.batch_sizes.split(",") if x]
    max_len = max([*prefills, args.decode_prompt_tokens + args.gen_tokens]) + 8
    t = time.monotonic()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=max(batches),
              max_num_batched_tokens=max(max_len, 2048), enable_prefix_caching=False, seed=args.seed)
    print(f"vllm_probe: engine up in {time.monotonic() - t:.0f} s", file=sys.stderr)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(args.seed)

    def prompts(n: int, length: int) -> list[TokensPrompt]:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(length)]) for _ in range(n)]

    def timed(batch: list[TokensPrompt], tokens: int) -> float:
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        return time.perf_counter() - t0

    timed(prompts(1, 64), 4)  # warm-up
    out: dict[str, object] = {"system": "vllm-cpu", "dtype": args.dtype, "threads": args.threads,
                              "prefill_tok_s": {}, "decode_tok_s": {}}
    for n in prefills:
        times = [timed(prompts(1, n), 1) for _ in range(args.runs)]
        out["prefill_tok_s"][str(n)] = round(n / statistics.median(times), 1)  # type: ignore[index]
        print(f"vllm_probe: prefill {n}: {out['prefill_tok_s'][str(n)]} tok/s", file=sys.stderr)  # type: ignore[index]
    for b in batches:
        batch = prompts(b, args.decode_prompt_tokens)
        one, full = timed(batch, 1), timed(batch, args.gen_tokens)
        out["decode_tok_s"][str(b)] = round((args.gen_tokens - 1) * b / max(full - one, 1e-9), 1)  # type: ignore[index]
        print(f"vllm_probe: decode B={b}: {out['decode_tok_s'][str(b)]} tok/s", file=sys.stderr)  # type: ignore[index]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
