"""Compute over paged KV: attention, KV writes, (de)quantization. Triton on CUDA, torch otherwise."""

from kernels.dispatch import paged_attention, write_kv
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]
