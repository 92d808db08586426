"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

Mental model: a small model's decode step on a GPU is a few hundred tiny kernel launches, and
Python's launch overhead, not the GPU, sets its time. So at start-up each bucket size b (1, 2, 4,
... up to max_num_seqs) gets one captured forward over *static* input tensors; a decode-only step
of n <= b rows copies its ids, positions, slots, lengths and block tables into the first n rows of
those tensors, fills the other b - n rows with padding that writes and reads only the runner's pad
block, and replays the graph. The static shapes are what make replay legal: every block table row
spans `max_model_len` tokens, and attention is told the longest context is `max_model_len` (the
decode kernel then picks the same split count at capture and replay, and skips a sequence's empty
splits at run time).

The graph-independent half (buckets, static buffers, padding, the metadata over them) runs on any
device: with `capture=False` `run` executes the same padded forward eagerly, which is how CPU tests
prove a padded step gives the rows exactly the logits of an unpadded one. Capture needs CUDA.
Mixture-of-experts layers read routing results on the host, so MoE models never use graphs.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from actors.engine.model_runner import ModelRunner, SeqChunk
from kernels import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_buckets(sizes: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The configured sizes up to max_num_seqs, plus max_num_seqs itself so every decode-only
    step fits one bucket."""
    return tuple(sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs}))


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, buckets: tuple[int, ...], max_model_len: int, *,
                 capture: bool = True) -> None:
        assert runner.pad_block is not None, "graphs need the runner's pad block"
        assert buckets and buckets == tuple(sorted(buckets))
        self.runner = runner
        self.buckets = buckets
        self.max_model_len = max_model_len
        self.max_blocks = math.ceil(max_model_len / runner.block_size)
        dev = runner.device
        b = buckets[-1]
        pin = dev.type == "cuda"
        # Static device inputs (the graphs read these addresses) and their host staging twins.
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slots = torch.full((b,), runner.pad_block * runner.block_size, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((b, self.max_blocks), runner.pad_block, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(b, dtype=torch.int64, device=dev)
        self._host_rows = torch.zeros(4, b, dtype=torch.int64, pin_memory=pin)  # ids, positions, slots, lens
        self._host_tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # each graph's static logits [b, V]
        self.num_replays = 0
        if capture:
            self._capture()

    def supports(self, chunks: list[SeqChunk]) -> bool:
        """A decode-only step that fits the largest bucket, every row due a sample."""
        return (0 < len(chunks) <= self.buckets[-1]
                and all(len(c.token_ids) == 1 and c.needs_logits and len(c.block_ids) <= self.max_blocks
                        for c in chunks))

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits [len(chunks), V] float32 in the chunks' order (a fresh tensor, not the graph's)."""
        n = len(chunks)
        b = self.bucket_for(n)
        self._stage(chunks, b)
        graph = self._graphs.get(b)
        if graph is None:  # not captured (CPU tests): the same padded forward, eagerly
            return self._forward(b)[:n].clone()
        graph.replay()
        self.num_replays += 1
        return self._outputs[b][:n].clone()

    # ----------------------------------------------------------------------------------- internals
    def _stage(self, chunks: list[SeqChunk], b: int) -> None:
        """Writes the step's rows, then padding, into the static inputs: one host->device copy
        per tensor, from pinned memory on CUDA, so nothing waits for the GPU here."""
        bs, pad, n = self.runner.block_size, self.runner.pad_block, len(chunks)
        rows = self._host_rows[:, :b]
        rows[:, n:] = torch.tensor([[0], [0], [pad * bs], [1]])  # padding: the pad block's first slot
        pos = [c.start_pos for c in chunks]
        rows[:, :n] = torch.tensor([
            [c.token_ids[0] for c in chunks], pos,
            [c.block_ids[p // bs] * bs + p % bs for c, p in zip(chunks, pos)], [p + 1 for p in pos],
        ], dtype=torch.int64)
        tables = self._host_tables[:b]
        table_np = tables.numpy()  # row slices through numpy: no tensor built per row
        table_np.fill(pad)
        for i, c in enumerate(chunks):
            table_np[i, : len(c.block_ids)] = c.block_ids
        nb = self.runner.device.type == "cuda"
        self.input_ids[:b].copy_(rows[0], non_blocking=nb)
        self.positions[:b].copy_(rows[1], non_blocking=nb)
        self.slots[:b].copy_(rows[2], non_blocking=nb)
        self.seq_lens[:b].copy_(rows[3], non_blocking=nb)
        self.block_tables[:b].copy_(tables, non_blocking=nb)

    def _meta(self, b: int) -> AttentionMetadata:
        # No host lists: the attention dispatcher then takes max_seq_len as the longest context,
        # the same at capture and at every replay.
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slots[:b], num_decodes=b,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, b: int) -> torch.Tensor:
        r = self.runner
        return r.model(self.input_ids[:b], self.positions[:b], r.kv_caches, self._meta(b), self.logits_indices[:b])

    def _capture(self) -> None:
        dev = self.runner.device
        if dev.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {dev}")
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        for b in reversed(self.buckets):  # largest first: the shared pool is sized once
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up: triton compiles, the allocator settles
                for _ in range(2):
                    self._forward(b)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[b] = self._forward(b)
            self._graphs[b] = graph
        torch.cuda.synchronize(dev)
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1fs", list(self.buckets),
                    time.perf_counter() - t0)
