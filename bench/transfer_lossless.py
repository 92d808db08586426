"""The lossless part of `bench/transfer.py`: the zstd codec on SmolLM2's real KV, and the entropy
coders it was picked from.

Mental model: prefill a window of this repository's README (real text) of each length, read the
prompt's KV blocks, and time the shipped codec (`zstd`: exponent split + zstd level 1) against
`none` on one core: bytes on the wire over raw bytes, encode and decode GB/s of raw KV, and a
bit-exactness check. The coder rows run each candidate entropy coder (zstd at several levels, lz4
where the `lz4` package is installed; it is not a dependency) on the same exponent bytes, so the
pick can be read off: the codec's whole-shard ratio it would give and the coder's own speed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import zstandard

from bench.common import best_s, format_table
from bench.common import progress as log
from kernels.exponent_split import split_exponents
from transfer.codec import KVLayout, decode, encode
from transfer.units import MIB

GB = 1e9
BLOCK_SIZE = 16


def real_kv(dtype: str, num_tokens: int) -> tuple[torch.Tensor, KVLayout]:
    """SmolLM2's KV [L, 2, n, bs, Hkv, D] for a README window of `num_tokens` tokens, in `dtype`."""
    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.fetch import resolve_model
    from actors.engine.model_runner import SeqChunk
    from actors.engine.tokenizer import Tokenizer
    from bench.shadow import doc_tokens, windows

    path = resolve_model("smollm2")
    ids = windows(doc_tokens(Tokenizer.load(path)), num_tokens, 1)[0]
    n = -(-len(ids) // BLOCK_SIZE)
    engine = Engine.from_pretrained(path, EngineConfig(block_size=BLOCK_SIZE, num_blocks=n + 1, dtype=dtype,
                                                       max_model_len=max(num_tokens, 2048)))
    cfg = engine.model_config
    with torch.inference_mode():
        engine.runner.execute([SeqChunk(ids, 0, list(range(n)), True)])
        kv = engine.runner.read_blocks(list(range(n))).clone()
    del engine
    return kv, KVLayout(cfg.name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE)


def _coders() -> dict[str, Callable[[bytes], bytes]]:
    coders: dict[str, Callable[[bytes], bytes]] = {
        f"zstd {level}": zstandard.ZstdCompressor(level=level).compress for level in (1, 3, -1, -5)}
    try:
        import lz4.block

        coders["lz4"] = lambda data: lz4.block.compress(data, store_size=False)
    except ImportError:
        pass
    return coders


def lossless_figures(dtypes: list[str], lengths: list[int], num_shards: int = 2) -> list[dict[str, Any]]:
    """A row per (dtype, prompt length): the codec's figures and each coder's on the exponent bytes."""
    threads = torch.get_num_threads()
    rows = []
    try:
        for dtype in dtypes:
            for num_tokens in lengths:
                log(f"lossless: SmolLM2 {dtype}, {num_tokens}-token prompt")
                kv, layout = real_kv(dtype, num_tokens)
                torch.set_num_threads(1)  # the codec's figures are one core's
                raw = kv.numel() * kv.element_size()
                row: dict[str, Any] = {"dtype": dtype, "prompt_tokens": num_tokens, "raw_mib": raw / MIB}
                for codec in ("none", "zstd"):
                    enc_s, shards = best_s(lambda c=codec: encode(kv, layout, compression=c, num_shards=num_shards))
                    dec_s, out = best_s(lambda s=shards: decode(s, layout))
                    row[codec] = {"ratio": raw / sum(map(len, shards)), "encode_gbps": raw / enc_s / GB,
                                  "decode_gbps": raw / dec_s / GB,
                                  "bit_exact": torch.equal(out.view(torch.uint8), kv.view(torch.uint8))}
                exps, rest = split_exponents(kv)
                plane = exps.numpy().tobytes()
                split_s, _ = best_s(lambda: split_exponents(kv))
                row["split_gbps"] = raw / split_s / GB
                row["coders"] = {}
                for name, coder in _coders().items():
                    s, packed = best_s(lambda c=coder: c(plane))
                    row["coders"][name] = {"codec_ratio": raw / (rest.numel() + len(packed)),
                                           "plane_ratio": len(plane) / len(packed), "plane_gbps": len(plane) / s / GB}
                torch.set_num_threads(threads)
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    codec_rows = [[r["dtype"], r["prompt_tokens"], r["raw_mib"], r["zstd"]["ratio"], r["zstd"]["encode_gbps"],
                   r["zstd"]["decode_gbps"], r["none"]["encode_gbps"], r["none"]["decode_gbps"],
                   r["zstd"]["bit_exact"] and r["none"]["bit_exact"]] for r in rows]
    out = format_table(["dtype", "prompt", "raw MiB", "zstd ratio", "zstd enc", "zstd dec", "none enc", "none dec",
                        "bit-exact"], codec_rows,
                       "Lossless zstd codec on SmolLM2's real KV, one core (raw GB/s; ratio = raw / wire bytes)")
    names = list(rows[0]["coders"]) if rows else []
    coder_rows = [[r["dtype"], r["prompt_tokens"], *(f"{r['coders'][n]['codec_ratio']:.3f} @ "
                                                     f"{r['coders'][n]['plane_gbps']:.2f}" for n in names)]
                  for r in rows]
    out += "\n\n" + format_table(["dtype", "prompt", *names], coder_rows,
                                 "Entropy coders on the exponent bytes: codec ratio @ coder GB/s of exponent bytes")
    return out
