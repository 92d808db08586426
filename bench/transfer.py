"""KV transfer benchmark: transport GB/s against this machine's limits, codec cost, and the quality
price of compressed KV on SmolLM2. One run, one table per part; `--json` prints the same figures.

Throughput is a round trip, the same for every row: the sender starts with the bytes in its memory
and stops the clock when the receiver says it has them in its own (preallocated) buffer. `memcpy` is
one copy in one process; `shm` copies into a shared segment, signals over a pipe, and the receiver
copies out and acks: the limits a transport between two processes on one machine works against.
Quality: prefill a prompt, ship its KV through the codec into fresh blocks, decode 64 greedy tokens
from each copy. "forced" feeds every copy the reference's tokens, so each step is a comparison of
its own (argmax agreement, max logit difference, KL). "free" lets each copy follow its own tokens:
after its first different token a copy writes another text, so free agreement mostly says where
the first flip fell. In bfloat16 the logits themselves are bf16, so a few percent of greedy steps
are exact ties between two tokens, and the bf16 forward magnifies any change to its input into
logit moves of that size: moving all KV values by one ulp, or a single one, flips about as many
forced tokens as int8 does. Hence two rows to read the codecs against: `1-ulp` (every KV value one
step of its dtype off, less than any lossy codec changes) and `float32 model` (the float32 model on
the same tokens), and a `(ties)` column that counts a pick tied with the other's as agreement.
float32 shows each codec's own error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

# Run as `python bench/transfer.py`, this file's folder comes first on sys.path and its own name
# would shadow the `transfer` package it measures.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from transfer.codec import Compression, KVLayout, decode, decode_shard, encode  # noqa: E402
# transfer.nixl imports the nixl package only inside NixlTransport and nixl_available: this file runs
# where nixl (or Ray, imported in object_store) is missing.
from transfer.nixl import NixlConfig, NixlTransport, nixl_available  # noqa: E402

MIB = 1 << 20
BLOCK_SIZE = 16  # the quality run's KV blocks
MODES = ("forced", "free")
GB = 1e9
PROMPTS = [
    "The history of the printing press begins in", "Photosynthesis is the process by which plants",
    "Write a short story about a lighthouse keeper who", "The three laws of thermodynamics state that",
    "In Python, a list comprehension is a concise way to", "The capital of Australia is Canberra, which",
    "A good recipe for banana bread needs", "The main causes of the French Revolution were",
    "To train a neural network, you first need", "Once upon a time in a small village by the sea,",
    "The difference between a virus and a bacterium is", "Explain how a bicycle stays upright while moving.",
    "The stock market crashed in 1929 because", "My favourite way to spend a rainy Sunday is",
    "The theory of plate tectonics explains", "Here is a haiku about autumn leaves:",
    "The most important rule of cybersecurity is", "Jupiter is the largest planet in our solar system and",
    "A healthy breakfast should include", "The key idea behind public-key cryptography is",
]


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def table(title: str, headers: list[str], rows: list[list[Any]]) -> str:
    def fmt_value(v: Any) -> str:
        if not isinstance(v, float):
            return str(v)
        return f"{v:.0f}" if v >= 100 else f"{v:.2f}" if v >= 1 else f"{v:.3f}"

    cells = [[fmt_value(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    fmt = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([title, fmt(headers), "  ".join("-" * w for w in widths), *map(fmt, cells)])


def reps_for(size: int) -> int:
    return 20 if size <= MIB else 8 if size <= 16 * MIB else 3


def timed_reps(size: int, once: Callable[[], None]) -> float:
    """Median GB/s of `once` moving `size` bytes, after one untimed warm-up."""
    once()
    times = []
    for _ in range(reps_for(size)):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times) / GB


# ---------------------------------------------------------------------------------- transports
def _receiver(kind: str, max_size: int, conn: Any) -> None:
    """Child process: receives into a preallocated buffer and acks each message."""
    dst = np.ones(max_size, dtype=np.uint8)  # written, so its pages are resident
    if kind == "shm":
        seg = shared_memory.SharedMemory(name=conn.recv())
        src = np.ndarray((max_size,), dtype=np.uint8, buffer=seg.buf)
        while (n := int.from_bytes(conn.recv_bytes(), "little")) > 0:
            dst[:n] = src[:n]
            conn.send_bytes(b"k")
        del src
        seg.close()
        return
    t = NixlTransport("bench-rx", NixlConfig(send_staging_bytes=MIB, recv_staging_bytes=max_size + MIB))
    conn.send_bytes(t.metadata())
    while conn.recv_bytes() == b"go":
        with t.recv(60.0) as d:
            dst[: len(d.data)] = np.frombuffer(d.data, dtype=np.uint8)
        conn.send_bytes(b"k")
    t.close()


def two_process(kind: str, sizes: list[int]) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(kind, max(sizes), child_end), daemon=True)
    proc.start()
    src = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
    out: dict[int, float] = {}
    try:
        if kind == "shm":
            seg = shared_memory.SharedMemory(create=True, size=max(sizes))
            buf = np.ndarray((max(sizes),), dtype=np.uint8, buffer=seg.buf)
            conn.send(seg.name)
            for size in sizes:
                def once(size: int = size) -> None:
                    buf[:size] = src[:size]
                    conn.send_bytes(size.to_bytes(8, "little"))
                    assert conn.poll(60) and conn.recv_bytes() == b"k"
                out[size] = timed_reps(size, once)
            conn.send_bytes((0).to_bytes(8, "little"))
            del buf
            seg.close()
            seg.unlink()
        else:
            t = NixlTransport("bench-tx", NixlConfig(send_staging_bytes=max(sizes) + MIB, recv_staging_bytes=MIB))
            assert conn.poll(120)
            t.add_peer(conn.recv_bytes())
            for size in sizes:
                def once(size: int = size) -> None:
                    conn.send_bytes(b"go")
                    t.send("bench-rx", [src[:size]], timeout_s=60.0)
                    assert conn.poll(60) and conn.recv_bytes() == b"k"
                out[size] = timed_reps(size, once)
            conn.send_bytes(b"stop")
            t.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


def object_store(sizes: list[int]) -> dict[int, float]:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # bind 127.0.0.1 only (NOTES-ray.md)
    import ray

    from transfer.object_store import ObjectStoreTransport

    class Rx:
        def __init__(self, max_size: int) -> None:
            self.t = ObjectStoreTransport("bench-rx", max_size + MIB)
            self.dst = np.ones(max_size, dtype=np.uint8)

        def metadata(self) -> bytes:
            return self.t.metadata()

        def take(self) -> int:
            with self.t.recv(60.0) as d:
                self.dst[: len(d.data)] = np.frombuffer(d.data, dtype=np.uint8)
                return len(d.data)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        tx = ObjectStoreTransport("bench-tx", MIB)
        rx = ray.remote(num_cpus=0.5)(Rx).remote(max(sizes))
        tx.add_peer(ray.get(rx.metadata.remote(), timeout=120))
        src = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
        out = {}
        for size in sizes:
            def once(size: int = size) -> None:
                taken = rx.take.remote()
                tx.send("bench-rx", [src[:size]], timeout_s=60.0)
                assert ray.get(taken, timeout=60) == size
            out[size] = timed_reps(size, once)
        tx.close()
        return out
    finally:
        ray.shutdown()


def local(sizes: list[int]) -> dict[int, float]:
    """The in-process transport, sender and receiver on one thread (it copies on send)."""
    from transfer.local import LocalTransport

    tx, rx = LocalTransport("bench-local-tx"), LocalTransport("bench-local-rx", max(sizes) + MIB)
    tx.add_peer(rx.metadata())
    src = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
    dst = np.ones_like(src)

    def once(size: int) -> None:
        tx.send("bench-local-rx", [src[:size]], timeout_s=60.0)
        with rx.recv(60.0) as d:
            dst[:size] = np.frombuffer(d.data, dtype=np.uint8)

    try:
        return {size: timed_reps(size, lambda size=size: once(size)) for size in sizes}
    finally:
        tx.close()
        rx.close()


def memcpy(sizes: list[int]) -> dict[int, float]:
    src = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
    dst = np.ones_like(src)
    return {size: timed_reps(size, lambda size=size: np.copyto(dst[:size], src[:size])) for size in sizes}


# ---------------------------------------------------------------------------------- codec
def codec_figures(num_blocks: int) -> list[dict[str, Any]]:
    """SmolLM2's KV shape (30 layers, 3 KV heads, head_dim 64, 16-token blocks) in bf16."""
    layout = KVLayout("smollm2", 30, 3, 64, 16)
    kv = (torch.randn(30, 2, num_blocks, 16, 3, 64, generator=torch.Generator().manual_seed(0)) * 2).bfloat16()
    raw = kv.numel() * kv.element_size()
    rows = []
    for c in Compression:
        enc_s, dec_s, shards = [], [], []
        for _ in range(3):
            t0 = time.perf_counter()
            shards = encode(kv, layout, compression=c, num_shards=4)
            enc_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for s in shards:
                decode_shard(s, layout).kv.contiguous()
            dec_s.append(time.perf_counter() - t0)
        rows.append({"codec": c.name.lower(), "raw_mib": raw / MIB, "wire_mib": sum(map(len, shards)) / MIB,
                     "ratio_vs_bf16": sum(map(len, shards)) / raw, "encode_gbps": raw / min(enc_s) / GB,
                     "decode_gbps": raw / min(dec_s) / GB})
    return rows


# ---------------------------------------------------------------------------------- quality
@dataclass
class Agreement:
    """One variant's forced steps against the reference's, tallied."""

    steps: int = 0
    same: int = 0  # argmax equal
    same_or_tied: int = 0  # ... or one side's logits tie its own pick with the other's (bf16 logits do)
    max_logit_diff: float = 0.0
    kl_sum: float = 0.0  # KL(reference || variant) of the next-token distributions, nats

    def add(self, logits: torch.Tensor, ref: torch.Tensor) -> None:
        """logits, ref: [rows, vocab] float32, row i of one against row i of the other."""
        a, r = logits.argmax(-1, keepdim=True), ref.argmax(-1, keepdim=True)
        same = (a == r)[:, 0]
        tied = (ref.gather(1, a) == ref.gather(1, r)) | (logits.gather(1, a) == logits.gather(1, r))
        log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
        self.steps += len(logits)
        self.same += int(same.sum())
        self.same_or_tied += int((same | tied[:, 0]).sum())
        self.max_logit_diff = max(self.max_logit_diff, float((logits - ref).abs().max()))
        self.kl_sum += float((log_p.exp() * (log_p - log_q)).sum())


def one_ulp_off(kv: torch.Tensor, seed: int) -> torch.Tensor:
    """Every value moved one step of its dtype, up or down at random: the smallest change to KV there
    is, so what it does to the tokens is the floor under any lossy codec."""
    up = torch.rand(kv.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    return torch.nextafter(kv, torch.where(up, torch.inf, -torch.inf).to(kv.dtype))


class DecodeBatch:
    """Sequences (prompt, name), each in its own blocks of one engine, decoded a forward per step."""

    def __init__(self, dtype: str, ids: list[list[int]], names: list[str], num_tokens: int) -> None:
        from actors.engine.config import EngineConfig
        from actors.engine.engine import Engine
        from actors.engine.fetch import resolve_model

        self.ids = ids
        n_blocks = -(-(max(map(len, ids)) + num_tokens) // BLOCK_SIZE)
        self.seqs = [(p, name) for p in range(len(ids)) for name in names]
        self.blocks = {sv: list(range(i * n_blocks, (i + 1) * n_blocks)) for i, sv in enumerate(self.seqs)}
        self.engine = Engine.from_pretrained(
            resolve_model("smollm2"),
            EngineConfig(block_size=BLOCK_SIZE, num_blocks=n_blocks * len(self.seqs), dtype=dtype))

    def prefill(self, name: str) -> torch.Tensor:
        """Every prompt into `name`'s blocks -> the logits after it, [num_prompts, vocab]."""
        from actors.engine.model_runner import SeqChunk

        return self.engine.runner.execute(
            [SeqChunk(ids, 0, self.blocks[(p, name)], True) for p, ids in enumerate(self.ids)])

    def step(self, step: int, feed: dict[tuple[int, str], int]) -> dict[tuple[int, str], torch.Tensor]:
        """Each sequence's token `feed[seq]` at position len(prompt) + step -> its logits [vocab]."""
        from actors.engine.model_runner import SeqChunk

        logits = self.engine.runner.execute(
            [SeqChunk([feed[(p, v)]], len(self.ids[p]) + step, self.blocks[(p, v)], True) for p, v in self.seqs])
        return dict(zip(self.seqs, logits))


def quality(num_prompts: int, num_tokens: int, dtype: str, prompt_tokens: int = 0) -> list[dict[str, Any]]:
    """Prefill each prompt once; ship its KV into fresh blocks through each codec; decode
    `num_tokens` greedy tokens from every copy, forced (fed the reference's tokens: per-step
    agreement, logit error) and free (its own tokens). Rows beside the codecs: `none` (bit-exact KV
    in other blocks and batch rows: must be 1.0), `1-ulp` (`one_ulp_off`: the floor), and for a
    reduced-precision dtype `float32 model`: the float32 model on the same tokens against this
    dtype's reference. `prompt_tokens` > 0: prompts of that many tokens of real text (windows of
    this repository's docs) instead of the short `PROMPTS`."""
    from actors.engine.fetch import resolve_model
    from actors.engine.tokenizer import Tokenizer
    from bench.shadow import doc_tokens, windows

    tok = Tokenizer.load(resolve_model("smollm2"))
    if prompt_tokens > 0:
        ids = windows(doc_tokens(tok), prompt_tokens, num_prompts)
    else:
        ids = [tok.encode(p) for p in PROMPTS[:num_prompts]]
    prompts = range(len(ids))
    kinds = ["none", "1-ulp", "int8", "fp8"]
    main = DecodeBatch(dtype, ids, ["ref"] + [f"{k}/{m}" for k in kinds for m in MODES], num_tokens)
    batches = [main]
    with torch.inference_mode():
        first = main.prefill("ref")
        cfg, runner = main.engine.model_config, main.engine.runner
        layout = KVLayout(cfg.name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE)
        for p in prompts:  # the decode side: the prompt's KV into each copy's own blocks
            n = -(-len(ids[p]) // BLOCK_SIZE)
            kv = runner.read_blocks(main.blocks[(p, "ref")][:n])
            shipped = {"1-ulp": one_ulp_off(kv, seed=p)} | {
                c: decode(encode(kv, layout, compression=c, num_shards=4), layout) for c in ("none", "int8", "fp8")}
            for k in kinds:
                for mode in MODES:
                    runner.write_blocks(main.blocks[(p, f"{k}/{mode}")][:n], shipped[k])
        tokens = {(p, v): [int(first[p].argmax())] for p, v in main.seqs}
        if dtype != "float32":
            f32 = DecodeBatch("float32", ids, [f"float32 model/{m}" for m in MODES], num_tokens)
            f32.prefill("float32 model/forced")
            own_first = f32.prefill("float32 model/free")
            tokens |= {(p, "float32 model/forced"): tokens[(p, "ref")][:1] for p in prompts}
            tokens |= {(p, "float32 model/free"): [int(own_first[p].argmax())] for p in prompts}
            kinds.append("float32 model")
            batches.append(f32)
        forced = {k: Agreement() for k in kinds}
        for step in range(num_tokens):
            feed = {(p, v): tokens[(p, "ref") if v.endswith("/forced") else (p, v)][-1] for p, v in tokens}
            rows = {sv: row for b in batches for sv, row in b.step(step, feed).items()}
            ref = torch.stack([rows[(p, "ref")] for p in prompts])
            for k in kinds:
                forced[k].add(torch.stack([rows[(p, f"{k}/forced")] for p in prompts]), ref)
            for sv, row in rows.items():
                tokens[sv].append(int(row.argmax()))
            if step % 16 == 15:
                log(f"quality: {step + 1}/{num_tokens} tokens")
    out = []
    for k in kinds:
        free = [[a == b for a, b in zip(tokens[(p, f"{k}/free")][1:], tokens[(p, "ref")][1:])] for p in prompts]
        a = forced[k]
        out.append({"variant": k, "forced_agreement": a.same / a.steps,
                    "forced_agreement_ties": a.same_or_tied / a.steps,
                    "free_agreement": sum(map(sum, free)) / (len(ids) * num_tokens),
                    "prompts_identical": sum(map(all, free)), "max_logit_diff": a.max_logit_diff,
                    "mean_kl": a.kl_sum / a.steps})
    return out


# ---------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    ap.add_argument("--sizes-mib", default="1,16,256")
    ap.add_argument("--parts", default="transport,codec,quality", help="which tables to produce")
    ap.add_argument("--no-ray", action="store_true", help="skip the object-store row (no Ray start)")
    ap.add_argument("--codec-blocks", type=int, default=128, help="KV blocks in the codec figures")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="quality: prompts of this many tokens of real text (the repo's docs); 0: short PROMPTS")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes for the quality figures, a table each")
    ap.add_argument("--transport", choices=["all", "cuda_ipc"], default="all",
                    help="cuda_ipc: only the same-node table, cuda_ipc between two processes vs one d2d copy"
                         " (needs torch, CUDA and cupy; neither Ray nor NIXL)")
    ap.add_argument("--device", default="cuda:0", help="--transport cuda_ipc: the GPU (cpu: shared host memory)")
    args = ap.parse_args()
    sizes = [int(s) * MIB for s in args.sizes_mib.split(",")]
    if args.transport == "cuda_ipc":
        from bench.transfer_ipc import print_cuda_ipc

        print_cuda_ipc(sizes, args.device, args.json)
        return
    parts = set(args.parts.split(","))
    figures: dict[str, Any] = {"sizes_mib": [s // MIB for s in sizes]}
    if "transport" in parts:
        log("memcpy and shared-memory limits")
        gbps = {"memcpy (1 process)": memcpy(sizes), "shm round trip": two_process("shm", sizes)}
        if nixl_available():
            log("nixl")
            gbps["nixl"] = two_process("nixl", sizes)
        if not args.no_ray:
            log("ray object store (starting a local cluster)")
            gbps["object_store"] = object_store(sizes)
        gbps["local (1 process)"] = local(sizes)
        figures["gbps"] = {k: {str(s // MIB): v for s, v in row.items()} for k, row in gbps.items()}
        if "nixl" in gbps:
            figures["nixl_vs_shm"] = {str(s // MIB): gbps["nixl"][s] / gbps["shm round trip"][s] for s in sizes}
    if "codec" in parts:
        log("codecs")
        figures["codec"] = codec_figures(args.codec_blocks)
    if "quality" in parts and args.prompts > 0:
        figures["quality"] = {}
        figures["quality_prompt_tokens"] = args.prompt_tokens or "short"
        for dtype in args.dtypes.split(","):
            log(f"quality on SmolLM2 in {dtype}")
            figures["quality"][dtype] = quality(args.prompts, args.tokens, dtype, args.prompt_tokens)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    if "gbps" in figures:
        head = [f"{s} MiB" for s in figures["sizes_mib"]]
        rows = [[k, *row.values()] for k, row in figures["gbps"].items()]
        if "nixl_vs_shm" in figures:
            rows.append(["nixl / shm", *figures["nixl_vs_shm"].values()])
        print(table("Transport round trip, GB/s (median)", ["path", *head], rows), end="\n\n")
    if "codec" in figures:
        keys = ["codec", "raw_mib", "wire_mib", "ratio_vs_bf16", "encode_gbps", "decode_gbps"]
        codec_rows = [[r[k] for k in keys] for r in figures["codec"]]
        print(table("Codec on SmolLM2-shaped bf16 KV, 4 shards", keys, codec_rows), end="\n\n")
    if "quality" in figures:
        keys = ["forced_agreement", "forced_agreement_ties", "free_agreement", "prompts_identical", "max_logit_diff",
                "mean_kl"]
        heads = ["forced", "forced (ties)", "free", "identical", "max_logit_diff", "mean_kl"]
        for dtype, q_rows in figures["quality"].items():
            fmt = {"prompts_identical": f"{{}}/{args.prompts}", "mean_kl": "{:.2e}", "max_logit_diff": "{:.3f}"}
            rows = [[r["variant"], *(fmt.get(k, "{:.4f}").format(r[k]) for k in keys)] for r in q_rows]
            length = f"{args.prompt_tokens}-token " if args.prompt_tokens else ""
            title = (f"Token agreement with uncompressed KV: SmolLM2 ({dtype}), {args.prompts} {length}prompts x "
                     f"{args.tokens} greedy tokens\n(forced: fed the reference's tokens, per step; (ties): a pick the other side's"
                     " logits tie with its own counts as agreement;\n free: its own tokens; max_logit_diff and"
                     " mean_kl (nats): forced steps; 1-ulp: every KV value one step off, the floor)")
            print(table(title, ["variant", *heads], rows), end="\n\n")


if __name__ == "__main__":
    main()
