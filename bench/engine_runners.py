"""The engines `bench/engine.py` times on the same prompts: ferry's own, transformers', and (with
`--peer vllm`) vLLM's CPU engine in its own venv.

Mental model: each runner loads its model once and answers the same three questions, so the bench
can divide one by the other: a `PREFILL_TOKENS`-token prefill, and decode steps at a batch of
`DECODE_PROMPT_TOKENS`-token prompts, on CPU or CUDA (synchronized before a clock stops).
`weight_bytes_per_decode_step` is what one decode step must stream from memory, for the bound.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from actors.engine.config import EngineConfig, parse_dtype
from actors.engine.engine import Engine
from actors.engine.model import CausalLM
from actors.engine.sampling import SamplingParams
from bench.common import progress
from bench.loadgen.peers import VLLM_PYTHON, hf_folder

PREFILL_TOKENS = 512
DECODE_PROMPT_TOKENS = 64
CPU_KV_CACHE_BYTES = 512 * 1024 * 1024  # the CPU bench's pool, as before the pool was planned
CUDA_MAX_MODEL_LEN = 1024  # CUDA: the longest request here is 512 + 1 tokens; graphs span this context


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------ ferry
class FerryRunner:
    def __init__(self, model: str | Path, dtype: str, max_batch: int, rng: random.Random,
                 device: torch.device, enforce_eager: bool = False, prefill_tokens: int = PREFILL_TOKENS) -> None:
        self.prefill_tokens = prefill_tokens
        batch_tokens = max(prefill_tokens, max_batch * DECODE_PROMPT_TOKENS)
        if device.type == "cpu":
            cfg = EngineConfig(
                dtype=dtype,
                device="cpu",
                max_num_seqs=max(max_batch, 1),
                # every decode prompt prefills in the first step, and the long prompt in one chunk
                max_num_batched_tokens=batch_tokens,
                kv_cache_bytes=CPU_KV_CACHE_BYTES,
            )
        else:  # the pool is planned from free device memory, capped by max_num_seqs x max_model_len
            cfg = EngineConfig(dtype=dtype, device=str(device), max_num_seqs=max(max_batch, 1),
                               max_num_batched_tokens=batch_tokens, max_model_len=max(CUDA_MAX_MODEL_LEN, prefill_tokens + 1),
                               enforce_eager=enforce_eager)
        self.device = device
        self.engine = Engine.from_pretrained(model, cfg)
        self.vocab_size = self.engine.model_config.vocab_size
        self.rng = rng
        self._next_id = 0

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(f"bench-{self._next_id}", prompt, params)
        self._next_id += 1

    def prefill_tok_s(self) -> float:
        self._add(random_prompt(self.rng, self.prefill_tokens, self.vocab_size), max_tokens=1)
        t0 = time.perf_counter()
        while self.engine.has_unfinished_requests():
            self.engine.step()
        synchronize(self.device)
        return self.prefill_tokens / (time.perf_counter() - t0)

    def decode_tok_s(self, batch: int, gen_tokens: int) -> dict[str, float]:
        for _ in range(batch):
            self._add(random_prompt(self.rng, DECODE_PROMPT_TOKENS, self.vocab_size), gen_tokens)
        started: set[str] = set()
        t0: float | None = None
        num_window_tokens = 0
        num_window_steps = 0
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            if t0 is None:
                started |= {o.request_id for o in outputs if o.new_token_ids}
                if len(started) == batch:
                    synchronize(self.device)
                    t0 = time.perf_counter()  # every sequence has its first token: decode only from here
            else:
                num_window_tokens += sum(len(o.new_token_ids) for o in outputs)
                num_window_steps += 1
        synchronize(self.device)
        elapsed_s = time.perf_counter() - t0 if t0 is not None else 0.0
        tok_s = num_window_tokens / elapsed_s if elapsed_s > 0 else 0.0
        return {"tok_s": tok_s, "tokens": num_window_tokens, "steps": num_window_steps, "seconds": elapsed_s}


def weight_bytes_per_decode_step(model: CausalLM) -> int:
    """Every distinct parameter once (a tied embedding is the lm_head's matrix, read by its
    matmul); an untied embedding only contributes the one row a single token looks up."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared params once
    emb = model.embed_tokens.weight
    if model.lm_head.weight is not emb:
        total -= emb.numel() * emb.element_size()
    return total + emb.shape[1] * emb.element_size()


# ----------------------------------------------------------------------------------- transformers
class TransformersRunner:
    def __init__(self, path: Path, dtype: str, rng: random.Random, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        if path.is_dir():  # an HF folder (random-smollm2 or a user's)
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=parse_dtype(dtype))
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=parse_dtype(dtype))
        # .to(dtype) too: a transformers that ignores `dtype=` must not bench float32 as bf16
        self.model = model.to(device=device, dtype=parse_dtype(dtype)).eval()
        self.device = device
        cfg = self.model.config
        eos = cfg.eos_token_id
        self.pad_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        self.vocab_size = cfg.vocab_size
        self.rng = rng

    def _generate_s(self, input_ids: torch.Tensor, new_tokens: int) -> float:
        synchronize(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.pad_token_id,
            )
        synchronize(self.device)
        elapsed_s = time.perf_counter() - t0
        if out.shape[1] != input_ids.shape[1] + new_tokens:
            progress(f"warning: generate made {out.shape[1] - input_ids.shape[1]} tokens, not {new_tokens}")
        return elapsed_s

    def _prompts(self, batch: int, num_tokens: int) -> torch.Tensor:
        rows = [random_prompt(self.rng, num_tokens, self.vocab_size) for _ in range(batch)]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def prefill_tok_s(self, num_tokens: int = PREFILL_TOKENS) -> float:
        return num_tokens / self._generate_s(self._prompts(1, num_tokens), 1)

    def decode_tok_s(self, batch: int, gen_tokens: int) -> dict[str, float]:
        ids = self._prompts(batch, DECODE_PROMPT_TOKENS)
        first_s = self._generate_s(ids, 1)
        full_s = self._generate_s(ids, gen_tokens)
        window_s = full_s - first_s
        tokens = (gen_tokens - 1) * batch
        return {"tok_s": tokens / window_s if window_s > 0 else 0.0, "tokens": tokens,
                "seconds": window_s, "generate_1_s": first_s, "generate_full_s": full_s}


# ------------------------------------------------------------------------------------------- vLLM
PROBE = Path(__file__).resolve().parent / "vllm_probe.py"


def vllm_figures(model: Path, dtype: str, batch_sizes: list[int], gen_tokens: int, threads: int, tmp: Path,
                 timeout_s: float = 1800.0, prefill_tokens: int = PREFILL_TOKENS) -> dict[str, Any]:
    """vLLM's CPU engine on the same weights and prompt lengths (bench/vllm_probe.py, run by the venv
    bench/build_peers.sh vllm makes; a GGUF is exported to an HF folder once, `hf_folder`), as that script's JSON;
    {"error": why} when vLLM is not installed or fails."""
    if not VLLM_PYTHON.exists():
        return {"error": f"vLLM not installed ({VLLM_PYTHON} missing: bench/build_peers.sh vllm)"}
    folder = model
    if not model.is_dir():
        progress(f"{dtype}: {model.name} as an HF folder for vLLM")
        folder = hf_folder(model, dtype)
    progress(f"{dtype}: vLLM CPU on the same weights (bench/vllm_probe.py)")
    argv = [str(VLLM_PYTHON), str(PROBE), "--model", str(folder), "--dtype", dtype,
            "--prefill-tokens", str(prefill_tokens), "--batch-sizes", ",".join(map(str, batch_sizes)),
            "--gen-tokens", str(gen_tokens), "--decode-prompt-tokens", str(DECODE_PROMPT_TOKENS),
            "--threads", str(threads)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
    except subprocess.TimeoutExpired:
        return {"error": f"vllm_probe did not finish within {timeout_s:g}s"}
    # vLLM logs to stdout too: the figures are the line the probe printed as JSON
    found = [line for line in done.stdout.splitlines() if line.startswith('{"system": "vllm-cpu"')]
    if done.returncode != 0 or not found:
        return {"error": f"vllm_probe exited {done.returncode}: {done.stderr.strip()[-400:]}"}
    return dict(json.loads(found[-1]))
