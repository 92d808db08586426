"""What a codec costs on this worker: seconds to encode and decode KV, and bytes it puts on the wire.

Mental model: every cost here is a line, `seconds = fixed_s + per_byte_s * bytes`, fitted by
least squares over decayed samples (`LineFit`: each new sample weighs 1, every older one loses
`decay` of its weight, so the fit follows a machine whose load changes). A codec's encode and
decode lines are over the KV's raw bytes; its wire ratio (wire bytes / raw bytes, headers
included) is a decayed mean. `calibrate` seeds them once, when a worker starts: it encodes and
decodes random KV of the worker's own layout, dtype and device at one block, ~1 MiB and ~8 MiB
(about 0.1-0.3 s for SmolLM2 on a CPU), so the chooser never starts from a guess about the codecs. Real
transfers then add their own samples (`CodecChooser.record`). The decode line stands for the
receiver's cost too: both ends of a handoff run on the same class of hardware, and the receiver
cannot report its own before the send returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from transfer.codec import HOST_ONLY, Compression, KVLayout, decode_shard, encode
from transfer.units import MIB

MIN_PER_BYTE_S = 1e-13  # 10 TB/s: a fitted slope is never taken as zero or negative


@dataclass
class LineFit:
    """y ~ fixed + per_byte * x over decayed samples (weighted least squares, O(1) per sample)."""

    decay: float = 0.2
    num_samples: int = 0
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - self.decay
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + x
        self._y = keep * self._y + y
        self._xx = keep * self._xx + x * x
        self._xy = keep * self._xy + x * y
        self.num_samples += 1

    def line(self, prior_fixed: float, prior_per_byte: float) -> tuple[float, float] | None:
        """(fixed, per_byte), or None before any sample. Both are fitted when the samples' sizes
        spread (a coefficient of variation over 10%); otherwise one size cannot tell a fixed cost
        from a per-byte one: a mean above the prior's adds to the fixed part (a slow small send is
        not taken for a slow wire), one below scales the prior down."""
        if self.num_samples == 0:
            return None
        mx, my = self._x / self._w, max(0.0, self._y / self._w)
        if mx <= 0:
            return my, MIN_PER_BYTE_S
        var = self._xx / self._w - mx * mx
        if var > (0.1 * mx) ** 2:
            slope = (self._xy / self._w - mx * my) / var
            if slope > 0:
                fixed = my - slope * mx
                return (fixed, max(slope, MIN_PER_BYTE_S)) if fixed >= 0 else (0.0, max(my / mx, MIN_PER_BYTE_S))
        prior = prior_fixed + prior_per_byte * mx
        if prior <= 0:
            return 0.0, max(my / mx, MIN_PER_BYTE_S)
        if my >= prior:  # slower than the prior: one size cannot say it is the bytes (queueing, a call's overhead)
            return my - prior_per_byte * mx, max(prior_per_byte, MIN_PER_BYTE_S)
        scale = my / prior
        return scale * prior_fixed, max(scale * prior_per_byte, MIN_PER_BYTE_S)

    def predict(self, x: float, prior_fixed: float, prior_per_byte: float) -> float:
        fit = self.line(prior_fixed, prior_per_byte)
        fixed, per_byte = fit if fit is not None else (prior_fixed, prior_per_byte)
        return fixed + per_byte * x


@dataclass
class CodecCost:
    """One codec's encode and decode lines over raw bytes, and its wire ratio."""

    codec: Compression
    encode: LineFit = field(default_factory=LineFit)
    decode: LineFit = field(default_factory=LineFit)
    wire_ratio: float = 1.0
    decay: float = 0.2

    def __post_init__(self) -> None:
        self.encode.decay = self.decode.decay = self.decay

    def add_ratio(self, raw_bytes: int, wire_bytes: int) -> None:
        if raw_bytes > 0:
            self.wire_ratio += self.decay * (wire_bytes / raw_bytes - self.wire_ratio)

    def codec_s(self, raw_bytes: int) -> float:
        """Encode plus decode seconds for `raw_bytes` of KV (0 before calibration: none then wins)."""
        return self.encode.predict(raw_bytes, 0.0, 0.0) + self.decode.predict(raw_bytes, 0.0, 0.0)


def random_kv(layout: KVLayout, num_blocks: int, dtype: torch.dtype, device: torch.device | str,
              seed: int = 0) -> torch.Tensor:
    """KV-like values of `layout`: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return (torch.randn(shape, generator=g) * 2).to(dtype=dtype, device=device)


def calibrate(layout: KVLayout, dtype: torch.dtype, device: torch.device | str = "cpu", *,
              device_shards: bool = False, num_shards: int = 2, sizes_bytes: tuple[int, int] = (MIB, 8 * MIB),
              reps: int = 3, decay: float = 0.2) -> dict[Compression, CodecCost]:
    """Every codec's cost on KV of this layout, dtype and device, from encoding and decoding it at
    one block and two sizes (whole blocks, at least 1 and 4 of them), the fastest of `reps` runs each.
    `device_shards`: encode to the KV's device, as for a transport that moves device memory (the
    host-only codecs are left out: such a worker never sends them)."""
    block_bytes = (layout.num_layers * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim
                   * torch.empty((), dtype=dtype).element_size())
    small = max(1, sizes_bytes[0] // block_bytes)
    # one block too: the fixed costs (per layer group and per block) that small transfers are made of
    counts = sorted({1, small, max(4 * small, sizes_bytes[1] // block_bytes)})
    shards = max(1, min(num_shards, layout.num_layers))
    costs = {c: CodecCost(c, decay=decay) for c in Compression if not (device_shards and c in HOST_ONLY)}
    warm = random_kv(layout, 1, dtype, device)
    for c in costs:  # first calls pay for lazy set-up (allocator, kernels): not a codec's cost
        for s in encode(warm, layout, compression=c, num_shards=1, device=warm.device if device_shards else None):
            decode_shard(s, layout)
    for n in counts:
        kv = random_kv(layout, n, dtype, device)
        raw = kv.numel() * kv.element_size()
        best: dict[Compression, list[float]] = {c: [float("inf"), float("inf")] for c in costs}
        for _ in range(reps):  # codecs interleaved, so a burst of load on the host hits one rep of each
            for c, cost in costs.items():
                t0 = time.perf_counter()
                out = encode(kv, layout, compression=c, num_shards=shards, device=kv.device if device_shards else None)
                _sync(kv.device)
                t1 = time.perf_counter()
                for s in out:
                    decode_shard(s, layout)
                _sync(kv.device)
                best[c] = [min(best[c][0], t1 - t0), min(best[c][1], time.perf_counter() - t1)]
                cost.wire_ratio = sum(s.numel() if isinstance(s, torch.Tensor) else len(s) for s in out) / raw
        for c, cost in costs.items():
            cost.encode.add(raw, best[c][0])
            cost.decode.add(raw, best[c][1])
    return costs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
